//! Who a process is in a training run and what it computes on: its rank among the ranks
//! torchrun's environment describes (a world of one without it), its device and its dtype.

use anyhow::{bail, Result};
use candle_core::{DType, Device};

use crate::config::Config;
use crate::dist::env::DistEnv;
use crate::recipe::setup;

/// One process of a run.
pub struct Session {
    /// The launch environment (a world of one without torchrun's variables).
    pub env: DistEnv,
    /// This process's rank, `0..world`.
    pub rank: usize,
    /// How many ranks the run has.
    pub world: usize,
    /// The device it computes on (`device`; `cuda` is the GPU of its local rank).
    pub device: Device,
    /// The dtype of the weights (`dtype`).
    pub dtype: DType,
}

impl Session {
    /// The session of recipe `recipe`: one rank of torchrun's group when `distributed`, else
    /// one device (refused when several processes were launched: `recipe`'s `_distributed` twin
    /// is named).
    pub fn start(cfg: &Config, recipe: &str, distributed: bool) -> Result<Session> {
        let env = DistEnv::from_env()?.unwrap_or_else(DistEnv::single);
        if !distributed && env.world_size > 1 {
            bail!(
                "recipe {recipe} runs on one device, but WORLD_SIZE is {}: use {} for several processes",
                env.world_size,
                recipe.replace("_single_device", "_distributed")
            );
        }
        let (rank, world) = match distributed {
            true => (env.rank, env.world_size),
            false => (0, 1),
        };
        let device = match distributed {
            true => setup::device_for_rank(cfg, env.local_rank)?,
            false => setup::device(cfg)?,
        };
        Ok(Session {
            env,
            rank,
            world,
            device,
            dtype: setup::dtype(cfg)?,
        })
    }

    /// Whether this is rank 0, which alone prints, logs and writes checkpoints (every rank
    /// computes).
    pub fn lead(&self) -> bool {
        self.rank == 0
    }

    /// Prints `msg` on rank 0.
    pub fn say(&self, msg: String) {
        if self.lead() {
            eprintln!("{msg}");
        }
    }
}
