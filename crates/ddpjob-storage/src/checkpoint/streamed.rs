//! A safetensors file written as its tensors arrive: a sharded job's checkpoint gathers its
//! state bucket by bucket, and rank 0 appends each bucket to the file instead of holding the
//! whole state (see `optim::sharded`, `train::full`).

use std::io::Write;
use std::path::Path;

/// A safetensors file of f32 tensors written front to back: the header, from the names and
/// shapes known in advance, then each tensor's values as they arrive, in the header's order.
pub struct StreamedSafetensors {
    out: std::io::BufWriter<std::fs::File>,
    expected: usize,
    written: usize,
}

impl StreamedSafetensors {
    /// A file at `path` for the f32 tensors `layout` names, with their shapes, in the order
    /// their values will be appended.
    pub fn create(path: &Path, layout: &[(String, Vec<usize>)]) -> std::io::Result<Self> {
        let mut header = serde_json::Map::new();
        let mut offset = 0;
        for (name, shape) in layout {
            let bytes = 4 * shape.iter().product::<usize>();
            let entry = serde_json::json!({
                "dtype": "F32",
                "shape": shape,
                "data_offsets": [offset, offset + bytes],
            });
            header.insert(name.clone(), entry);
            offset += bytes;
        }
        let mut json = serde_json::to_vec(&header).unwrap_or_default();
        // Padded with spaces so the data starts 8-byte aligned, as safetensors writes it.
        while !(8 + json.len()).is_multiple_of(8) {
            json.push(b' ');
        }
        let mut out = std::io::BufWriter::new(std::fs::File::create(path)?);
        out.write_all(&(json.len() as u64).to_le_bytes())?;
        out.write_all(&json)?;
        Ok(StreamedSafetensors {
            out,
            expected: offset,
            written: 0,
        })
    }

    /// The next tensor's values (or the next part of them).
    pub fn append(&mut self, values: &[f32]) -> std::io::Result<()> {
        self.written += 4 * values.len();
        self.out.write_all(bytemuck::cast_slice(values))
    }

    /// Flushed and synced, once every value the header promised is written.
    pub fn finish(mut self) -> std::io::Result<()> {
        if self.written != self.expected {
            return Err(std::io::Error::other(format!(
                "{} bytes of tensors written, {} expected",
                self.written, self.expected
            )));
        }
        self.out.flush()?;
        self.out.get_ref().sync_all()
    }
}
