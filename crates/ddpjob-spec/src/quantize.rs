//! `[model.quantize]` as the job describes it (QLoRA): the frozen base's linear layers kept in
//! 4 bits as bitsandbytes' `BitsAndBytesConfig(load_in_4bit = True)` keeps them, its type,
//! block size and whether the blocks' scales are quantised again. The codes themselves and the
//! products over them are the kernels crate's; this is only what a job asks for.

/// The 4-bit type (`model.quantize.type`, bitsandbytes' `bnb_4bit_quant_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuantType {
    /// NormalFloat4, QLoRA's.
    Nf4,
    /// bitsandbytes' 4-bit float.
    Fp4,
}

impl QuantType {
    /// Its name in job files and in bitsandbytes' `quant_state`.
    pub fn name(self) -> &'static str {
        match self {
            QuantType::Nf4 => "nf4",
            QuantType::Fp4 => "fp4",
        }
    }
}

/// `[model.quantize]` once it is on (`bits = 4`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QuantizeSpec {
    pub kind: QuantType,
    /// Values per scale (bitsandbytes' `blocksize`).
    pub block_size: usize,
    /// The scales kept as 8-bit codes in blocks of 256 (`bnb_4bit_use_double_quant`).
    pub double_quant: bool,
}

impl QuantizeSpec {
    /// Bytes a weight of `len` values takes in memory here: two codes a byte and an f32 scale
    /// per block (nested scales are de-quantised once when the weight is made).
    pub fn bytes(&self, len: usize) -> usize {
        len.div_ceil(2) + 4 * len.div_ceil(self.block_size)
    }

    /// `nf4, blocks of 64, double quantisation`.
    pub fn describe(&self) -> String {
        let nested = match self.double_quant {
            true => ", double quantisation",
            false => "",
        };
        format!(
            "4-bit {}, blocks of {}{nested}",
            self.kind.name(),
            self.block_size
        )
    }
}

/// The block sizes bitsandbytes takes.
pub const BLOCK_SIZES: [usize; 8] = [32, 64, 128, 256, 512, 1024, 2048, 4096];
