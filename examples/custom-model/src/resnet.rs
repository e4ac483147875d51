//! A small ResNet written with plain `candle_nn` layers: a convolutional stem, residual blocks
//! (conv-BN-ReLU-conv-BN plus the block's input), global average pooling and a classifier.
//! BatchNorm keeps running statistics: ddpjob checkpoints them and keeps the ranks in step.
//! Without it (`batch_norm = false`, each convolution then has a bias) the network has no
//! statistics, and can train world-size-invariantly.

use candle_core::{Result, Tensor};
use candle_nn::{BatchNorm, Conv2d, Conv2dConfig, Linear, Module, ModuleT, VarBuilder};
use ddpjob::{BuildError, Mode, Model, ModelContext, ModelInput, ParamStore, Params};
use serde::{Deserialize, Serialize};

/// `[model]` keys besides `arch = "tiny-resnet"`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Options {
    /// Channels of the stem and of every block.
    #[serde(default = "default_channels")]
    pub channels: usize,
    /// Residual blocks after the stem.
    #[serde(default = "default_blocks")]
    pub blocks: usize,
    /// BatchNorm after each convolution (else a bias on it).
    #[serde(default = "default_batch_norm")]
    pub batch_norm: bool,
}

fn default_batch_norm() -> bool {
    true
}

fn default_channels() -> usize {
    8
}

fn default_blocks() -> usize {
    1
}

pub struct TinyResNet {
    stem: ConvBn,
    blocks: Vec<(ConvBn, ConvBn)>,
    head: Linear,
    params: Params,
}

/// A 3×3 convolution (padding 1) followed by BatchNorm, or with a bias of its own instead.
struct ConvBn {
    conv: Conv2d,
    bn: Option<BatchNorm>,
}

impl ConvBn {
    fn new(inputs: usize, outputs: usize, batch_norm: bool, vb: VarBuilder) -> Result<Self> {
        let config = Conv2dConfig {
            padding: 1,
            ..Default::default()
        };
        if !batch_norm {
            return Ok(ConvBn {
                conv: candle_nn::conv2d(inputs, outputs, 3, config, vb.pp("conv"))?,
                bn: None,
            });
        }
        Ok(ConvBn {
            conv: candle_nn::conv2d_no_bias(inputs, outputs, 3, config, vb.pp("conv"))?,
            bn: Some(candle_nn::batch_norm(outputs, 1e-5, vb.pp("bn"))?),
        })
    }

    fn forward(&self, xs: &Tensor, train: bool) -> Result<Tensor> {
        let ys = self.conv.forward(xs)?;
        match &self.bn {
            Some(bn) => bn.forward_t(&ys, train),
            None => Ok(ys),
        }
    }
}

impl TinyResNet {
    /// The builder registered as `tiny-resnet`: learns from images of any size.
    pub fn build(options: &Options, cx: &ModelContext) -> std::result::Result<Self, BuildError> {
        let ModelInput::Image { shape, classes } = cx.input else {
            return Err(format!("tiny-resnet learns from images, not {:?}", cx.input).into());
        };
        if options.channels == 0 {
            return Err("model.channels must be at least 1".into());
        }
        let store = ParamStore::new(cx);
        let vb = store.var_builder();
        let (c, bn) = (options.channels, options.batch_norm);
        let stem = ConvBn::new(shape[0], c, bn, vb.pp("stem"))?;
        let blocks = (0..options.blocks)
            .map(|i| {
                let vb = vb.pp(format!("layer{}", i + 1));
                Ok((
                    ConvBn::new(c, c, bn, vb.pp("a"))?,
                    ConvBn::new(c, c, bn, vb.pp("b"))?,
                ))
            })
            .collect::<Result<Vec<_>>>()?;
        let head = candle_nn::linear(c, classes, vb.pp("fc"))?;
        Ok(TinyResNet {
            stem,
            blocks,
            head,
            params: store.finish(),
        })
    }
}

impl Model for TinyResNet {
    fn forward(&self, xs: &Tensor, mode: &Mode) -> Result<Tensor> {
        let train = mode.is_train();
        let mut h = self.stem.forward(xs, train)?.relu()?;
        for (a, b) in &self.blocks {
            let inner = b.forward(&a.forward(&h, train)?.relu()?, train)?;
            h = (inner + h)?.relu()?;
        }
        self.head.forward(&h.mean((2, 3))?)
    }

    fn params(&self) -> &Params {
        &self.params
    }
}
