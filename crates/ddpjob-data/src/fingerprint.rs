//! What a job's text or token files were when it began (`data-files.json` in the job): a
//! resumed job must read the data it trained on to continue where it stopped, and a file
//! changed since (a shortened corpus shifts every window and the sampler's order) is refused
//! instead of silently training on something else.

use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::DataError;
use ddpjob_seam::JobFile;

/// The file in the job directory.
pub const FILE: &str = "data-files.json";

/// Bytes read from each end of a file: a corpus of many GB is not read whole to resume it.
const SAMPLE: u64 = 1 << 20;

/// One file: its length and the SHA-256 of its first and last MiB (all of a smaller one).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Fingerprint {
    path: String,
    bytes: u64,
    ends_sha256: String,
}

fn fingerprint(path: &Path) -> Result<Fingerprint, DataError> {
    let io = |cause| DataError::Io {
        path: path.into(),
        cause,
    };
    let mut file = std::fs::File::open(path).map_err(io)?;
    let bytes = file.metadata().map_err(io)?.len();
    let mut hash = Sha256::new();
    let mut buf = Vec::new();
    (&mut file).take(SAMPLE).read_to_end(&mut buf).map_err(io)?;
    hash.update(&buf);
    buf.clear();
    // The last MiB, or what a smaller file has after its first.
    if bytes > 2 * SAMPLE {
        file.seek(SeekFrom::Start(bytes - SAMPLE)).map_err(io)?;
    }
    file.take(SAMPLE).read_to_end(&mut buf).map_err(io)?;
    hash.update(&buf);
    Ok(Fingerprint {
        path: path.display().to_string(),
        bytes,
        ends_sha256: ddpjob_storage::jobdir::hex(&hash.finalize()),
    })
}

/// For a job being created (`job` is `None`, or has no record yet): the record of `paths` to
/// keep in it. For one being resumed: `paths` compared with its record, a change refused.
pub fn keep_or_compare(paths: &[&Path], job: Option<&Path>) -> Result<Vec<JobFile>, DataError> {
    let now = paths
        .iter()
        .map(|p| fingerprint(p))
        .collect::<Result<Vec<_>, _>>()?;
    let stored = job.map(|j| j.join(FILE)).filter(|p| p.is_file());
    let Some(stored) = stored else {
        let bytes = serde_json::to_vec_pretty(&now).unwrap_or_default();
        return Ok(vec![JobFile::bytes(FILE, bytes)]);
    };
    let then: Vec<Fingerprint> = std::fs::read(&stored)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .ok_or_else(|| DataError::Corrupt {
            path: stored.clone(),
            problem: "it is not the record of the job's data files; delete it to resume \
                      without the check"
                .into(),
        })?;
    // By place (a text; or the training then the validation tokens), whatever the path says
    // now: a job.toml edited to name another file is compared too.
    for (old, new) in then.iter().zip(&now) {
        if (old.bytes, &old.ends_sha256) != (new.bytes, &new.ends_sha256) {
            let how = match old.bytes == new.bytes {
                true => format!("its contents differ ({} bytes both)", new.bytes),
                false => format!("{} bytes then, {} now", old.bytes, new.bytes),
            };
            return Err(DataError::Mismatch(format!(
                "`{}` changed since the job began ({how}): a resumed job must read the data \
                 it trained on to continue where it stopped; restore the file, or start a new \
                 job from this one's weights (model.init_from = \"{}\")",
                new.path,
                job.map_or(String::new(), |j| j.display().to_string())
            )));
        }
    }
    Ok(Vec::new())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_changed_file_is_refused_an_unchanged_one_passes() {
        let tmp = tempfile::tempdir().unwrap();
        let (text, job) = (tmp.path().join("input.txt"), tmp.path().join("job"));
        std::fs::create_dir(&job).unwrap();
        let big: Vec<u8> = (0..3 * SAMPLE + 5).map(|i| (i % 251) as u8).collect();
        std::fs::write(&text, &big).unwrap();
        let kept = keep_or_compare(&[&text], None).unwrap();
        assert_eq!(kept[0].name, FILE);
        std::fs::write(job.join(FILE), &*kept[0].read().unwrap()).unwrap();
        assert!(keep_or_compare(&[&text], Some(&job)).unwrap().is_empty());
        // Shortened: the length says so.
        std::fs::write(&text, &big[..big.len() - 1]).unwrap();
        let err = keep_or_compare(&[&text], Some(&job))
            .unwrap_err()
            .to_string();
        assert!(err.contains("changed since the job began"), "{err}");
        assert!(err.contains(&format!("{} bytes then, {} now", big.len(), big.len() - 1)));
        // The same length, its last MiB edited.
        let mut edited = big.clone();
        *edited.last_mut().unwrap() ^= 1;
        std::fs::write(&text, &edited).unwrap();
        let err = keep_or_compare(&[&text], Some(&job))
            .unwrap_err()
            .to_string();
        assert!(err.contains("its contents differ"), "{err}");
        // A job from before the record: nothing to compare, a record to keep.
        std::fs::remove_file(job.join(FILE)).unwrap();
        assert_eq!(keep_or_compare(&[&text], Some(&job)).unwrap().len(), 1);
    }
}
