//! The llama's mixtures of experts as the trainer sees them: the load-balancing loss beside
//! the language model's (logged as `aux_loss`, in the objective times `router_aux_loss_coef`
//! when `output_router_logits`), for a pass over the whole model and for one that goes layer
//! by layer (`kit::layered`: each layer's backward differentiates its own share).

use candle_core::{DType, Result, Tensor};

use super::Llama;
use super::moe::{AuxWeights, Routing};
use crate::kit::layered::{Side, SideLoss};

impl Llama {
    /// `loss` with the load-balancing loss of `routings` (every sparse layer's, in order) for
    /// `targets`: (the objective, [loss, aux_loss] as logged). Without experts: the loss alone.
    pub(super) fn with_aux(
        &self,
        loss: Tensor,
        routings: &[Routing],
        targets: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        let Some(aux) = self.aux_weights(&routings.iter().collect::<Vec<_>>(), targets)? else {
            let logged = loss.detach().reshape(1)?;
            return Ok((loss, logged));
        };
        let mut term: Option<Tensor> = None;
        for routing in routings {
            let share = aux.share(routing)?;
            term = Some(match term {
                Some(t) => (t + share)?,
                None => share,
            });
        }
        let term = term.map_or_else(|| loss.zeros_like(), Ok)?;
        let logged = Tensor::cat(&[loss.detach().reshape(1)?, term.detach().reshape(1)?], 0)?;
        let objective = match aux.coef {
            0.0 => loss,
            coef => (loss + (term * coef)?)?,
        };
        Ok((objective, logged))
    }

    /// The load-balancing loss's weights for this batch, `None` without experts.
    pub(super) fn aux_weights(
        &self,
        routings: &[&Routing],
        targets: &Tensor,
    ) -> Result<Option<AuxLoss>> {
        let Some(m) = &self.config.moe else {
            return Ok(None);
        };
        let ignore = ddpjob_seam::task::IGNORE_TARGET;
        let scored: Vec<Vec<bool>> = targets
            .to_dtype(DType::U32)?
            .to_vec2::<u32>()?
            .into_iter()
            .map(|row| row.into_iter().map(|y| y != ignore).collect())
            .collect();
        let device = targets.device();
        let weights = AuxWeights::of(routings, m.num_experts, m.top_k, &scored, device)?;
        Ok(weights.map(|weights| AuxLoss {
            weights,
            coef: if m.aux_in_loss { m.aux_coef } else { 0.0 },
        }))
    }
}

/// The load-balancing loss of one batch, a sum of one share per sparse layer.
pub(super) struct AuxLoss {
    weights: AuxWeights,
    coef: f64,
}

impl SideLoss<Routing> for AuxLoss {
    fn share(&self, side: &Routing) -> Result<Tensor> {
        self.weights.term(side)
    }

    fn coef(&self) -> f64 {
        self.coef
    }
}

impl Side for Routing {
    fn detach(&self) -> Self {
        Routing {
            probs: self.probs.detach(),
            chosen: self.chosen.clone(),
        }
    }
}
