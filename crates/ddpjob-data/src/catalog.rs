//! Where MNIST-format datasets live: standard file names, Debian's install location, known
//! mirrors and their SHA-256 digests; finds each file or downloads it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use super::DataError;
use super::download::download;

/// The four IDX files of an MNIST-format dataset, without `.gz`.
pub const FILES: [&str; 4] = [
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
];

/// A downloadable MNIST-format dataset.
pub struct Catalog {
    pub name: &'static str,
    pub mirrors: &'static [&'static str],
    /// SHA-256 of each `<file>.gz` as published.
    pub sha256: [&'static str; 4],
}

pub const MNIST: Catalog = Catalog {
    name: "mnist",
    mirrors: &[
        "https://ossci-datasets.s3.amazonaws.com/mnist",
        "https://storage.googleapis.com/cvdf-datasets/mnist",
    ],
    sha256: [
        "440fcabf73cc546fa21475e81ea370265605f56be210a4024d2ca8f203523609",
        "3552534a0a558bbed6aed32b30c495cca23d567ec52cac8be1a0730e8010255c",
        "8d422c7b0a1c1c79245a5bcf07fe86e33eeafee792b84584aec276f5a2dbc4e6",
        "f7ae60f92e00ec6debd23a6088c31dbd2371eca3ffa0defaaed8b6ca2bff9b3d",
    ],
};

pub const FASHION_MNIST: Catalog = Catalog {
    name: "fashion-mnist",
    mirrors: &["http://fashion-mnist.s3-website.eu-central-1.amazonaws.com"],
    sha256: [
        "3aede38d61863908ad78613f6a32ed271626dd12800ba2636569512369268a84",
        "a04f17134ac03560a47e3764e11b92fc97de4d1bfaf8ba1a3aa29af54cc90845",
        "346e55b948d973a97e58d2351dde16a484bd415d4595297633bb08f03db6a073",
        "67da17c76eaffca5446c3361aaab5c3cd6d1c2608764d35dfb1850b086bf8dd5",
    ],
};

/// Where to look and how to fetch.
pub struct Locate<'a> {
    pub root: &'a Path,
    /// Searched after `root`: Debian's `/usr/share/datasets/<name>`.
    pub system_dir: PathBuf,
    pub download: bool,
    /// Overrides the catalog's mirrors when not empty.
    pub mirrors: &'a [String],
    /// Overrides the catalog's digests per `<file>.gz` name.
    pub checksums: &'a BTreeMap<String, String>,
}

impl Catalog {
    /// Paths of the four files (`FILES` order), found or downloaded into `root`, all from one
    /// directory: `root` when it holds any of them (the rest downloaded there, or missing),
    /// else the system's when it holds all four, else `root` (downloaded). Splits from two
    /// directories would train on one dataset and evaluate on another.
    pub fn locate(&self, how: &Locate) -> Result<[PathBuf; 4], DataError> {
        let in_dir = |d: &Path| -> Vec<Option<PathBuf>> {
            FILES
                .iter()
                .map(|file| {
                    [d.join(file), d.join(format!("{file}.gz"))]
                        .into_iter()
                        .find(|p| p.is_file())
                })
                .collect()
        };
        let (in_root, in_system) = (in_dir(how.root), in_dir(&how.system_dir));
        let system_whole = in_system.iter().all(Option::is_some);
        let partial_root = in_root.iter().any(Option::is_some);
        let hits = match (partial_root, system_whole) {
            (false, true) => in_system,
            _ => in_root,
        };
        let mut found: Vec<PathBuf> = Vec::with_capacity(4);
        let mut missing = Vec::new();
        for (i, (file, hit)) in FILES.iter().zip(hits).enumerate() {
            match hit {
                Some(p) => found.push(p),
                None if how.download => {
                    let gz = format!("{file}.gz");
                    let digest = how
                        .checksums
                        .get(&gz)
                        .map(String::as_str)
                        .or(Some(self.sha256[i]));
                    let mirrors: Vec<String> = if how.mirrors.is_empty() {
                        self.mirrors.iter().map(|m| m.to_string()).collect()
                    } else {
                        how.mirrors.to_vec()
                    };
                    let dest = how.root.join(&gz);
                    download(&mirrors, &gz, digest, &dest)?;
                    found.push(dest);
                }
                None => {
                    missing.push(file.to_string());
                    found.push(PathBuf::new());
                }
            }
        }
        if !missing.is_empty() && partial_root {
            return Err(DataError::Mismatch(format!(
                "{}: `{}` (data.root) holds only some of the four IDX files (missing {}); all \
                 four are read from one directory, so that training and test splits are of one \
                 dataset: put the missing ones there, remove these to use {}'s, or set \
                 data.download = true",
                self.name,
                how.root.display(),
                missing.join(", "),
                how.system_dir.display()
            )));
        }
        if !missing.is_empty() {
            return Err(DataError::NotFound {
                dataset: self.name.into(),
                missing,
                // Only an empty data.root gets here: both places were looked in.
                searched: vec![how.root.to_path_buf(), how.system_dir.clone()],
            });
        }
        Ok([
            found[0].clone(),
            found[1].clone(),
            found[2].clone(),
            found[3].clone(),
        ])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn put(dir: &Path, files: &[&str]) {
        std::fs::create_dir_all(dir).unwrap();
        for f in files {
            std::fs::write(dir.join(f), b"").unwrap();
        }
    }

    #[test]
    fn the_four_files_come_from_one_directory() {
        let tmp = tempfile::tempdir().unwrap();
        let (root, system) = (tmp.path().join("root"), tmp.path().join("system"));
        let gz: Vec<String> = FILES.iter().map(|f| format!("{f}.gz")).collect();
        put(&system, &gz.iter().map(String::as_str).collect::<Vec<_>>());
        let sums = BTreeMap::new();
        let locate = |root: &Path| {
            FASHION_MNIST.locate(&Locate {
                root,
                system_dir: system.clone(),
                download: false,
                mirrors: &[],
                checksums: &sums,
            })
        };
        // Nothing in data.root: the system's four.
        let found = locate(&root).unwrap();
        assert!(found.iter().all(|p| p.starts_with(&system)), "{found:?}");
        // data.root with the test split only: not trained on the system's train split and
        // evaluated on data.root's test split; the missing ones are named.
        put(&root, &[FILES[2], FILES[3]]);
        let err = locate(&root).unwrap_err().to_string();
        assert!(
            err.contains(&format!(
                "`{}` (data.root) holds only some of the four IDX files (missing {}, {})",
                root.display(),
                FILES[0],
                FILES[1]
            )) && err.contains(&format!("remove these to use {}'s", system.display())),
            "{err}"
        );
        // All four there (raw or .gz): data.root's.
        put(&root, &[&gz[0], FILES[1]]);
        let found = locate(&root).unwrap();
        assert!(found.iter().all(|p| p.starts_with(&root)), "{found:?}");
    }
}
