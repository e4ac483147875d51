//! `make-data [DIR]`: writes the example's `train.csv` (480 samples) and `test.csv` (120) into
//! DIR (default: the current directory): three classes of 8×8 images (a bright row, a bright
//! column, the diagonal) in noise, as `label,p0,...,p63` lines with a header; deterministic.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

fn images(samples: usize, mut seed: u64) -> String {
    let mut next = || {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((seed >> 33) as f64 / (1u64 << 31) as f64) as f32
    };
    let mut text = String::from("label");
    (0..64).for_each(|i| text.push_str(&format!(",p{i}")));
    text.push('\n');
    for i in 0..samples {
        let class = i % 3;
        let k = (next() * 8.0) as usize % 8;
        let mut pixels: Vec<f32> = (0..64).map(|_| (next() - 0.5) * 0.6).collect();
        for j in 0..8 {
            let at = match class {
                0 => k * 8 + j,
                1 => j * 8 + k,
                _ => j * 8 + j,
            };
            pixels[at] += 1.0;
        }
        text.push_str(&class.to_string());
        pixels
            .iter()
            .for_each(|p| text.push_str(&format!(",{p:.4}")));
        text.push('\n');
    }
    text
}

fn write(dir: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    std::fs::write(dir.join("train.csv"), images(480, 1))?;
    std::fs::write(dir.join("test.csv"), images(120, 2))
}

fn main() -> ExitCode {
    let dir = std::env::args_os()
        .nth(1)
        .map_or_else(|| PathBuf::from("."), PathBuf::from);
    match write(&dir) {
        Ok(()) => {
            println!("wrote {0}/train.csv and {0}/test.csv", dir.display());
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!(
                "error: cannot write the CSV files into `{}`: {e}",
                dir.display()
            );
            ExitCode::from(1)
        }
    }
}
