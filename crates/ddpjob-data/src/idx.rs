//! The IDX format of MNIST-style datasets: big-endian header (magic, dimensions), then u8 data.
//! Files may be gzip-compressed; everything is checked so a damaged file fails with its name.

use std::io::Read;
use std::path::{Path, PathBuf};

use super::DataError;

/// An IDX array of unsigned bytes: its dimensions and data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdxArray {
    pub dims: Vec<usize>,
    pub data: Vec<u8>,
}

/// Reads `path`, gunzipping when it starts with the gzip magic.
pub fn read_idx(path: &Path) -> Result<IdxArray, DataError> {
    let raw = std::fs::read(path).map_err(|cause| DataError::Io {
        path: path.into(),
        cause,
    })?;
    let bytes = if raw.starts_with(&[0x1f, 0x8b]) {
        let mut out = Vec::with_capacity(raw.len() * 4);
        flate2::read::MultiGzDecoder::new(raw.as_slice())
            .read_to_end(&mut out)
            .map_err(|e| {
                corrupt(
                    path,
                    format!(
                        "gzip data is damaged ({e}); delete the file so it can be fetched again"
                    ),
                )
            })?;
        out
    } else {
        raw
    };
    parse_idx(path, &bytes)
}

fn corrupt(path: &Path, problem: String) -> DataError {
    DataError::Corrupt {
        path: PathBuf::from(path),
        problem,
    }
}

/// Parses IDX bytes (already decompressed); `path` names the file in errors.
pub fn parse_idx(path: &Path, bytes: &[u8]) -> Result<IdxArray, DataError> {
    if bytes.len() < 4 {
        return Err(corrupt(
            path,
            format!("only {} bytes, too short for an IDX header", bytes.len()),
        ));
    }
    if bytes[0] != 0 || bytes[1] != 0 {
        return Err(corrupt(
            path,
            format!(
                "bad magic 0x{}: not an IDX file (one starts with two zero bytes, a type byte \
                 and its number of dimensions)",
                ddpjob_storage::jobdir::hex(&bytes[..4])
            ),
        ));
    }
    if bytes[2] != 0x08 {
        return Err(corrupt(
            path,
            format!(
                "element type 0x{:02x}; only unsigned bytes (0x08) are supported",
                bytes[2]
            ),
        ));
    }
    let ndim = bytes[3] as usize;
    if ndim == 0 {
        return Err(corrupt(path, "zero dimensions".into()));
    }
    let header_len = 4 + 4 * ndim;
    if bytes.len() < header_len {
        return Err(corrupt(
            path,
            format!(
                "header says {ndim} dimensions but the file ends after {} bytes",
                bytes.len()
            ),
        ));
    }
    let dims: Vec<usize> = bytes[4..header_len]
        .chunks_exact(4)
        .map(|c| u32::from_be_bytes([c[0], c[1], c[2], c[3]]) as usize)
        .collect();
    let expected = dims.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d));
    let actual = bytes.len() - header_len;
    match expected {
        Some(n) if n == actual => Ok(IdxArray {
            dims,
            data: bytes[header_len..].to_vec(),
        }),
        Some(n) if n > actual => Err(corrupt(
            path,
            format!("truncated: dimensions {dims:?} need {n} data bytes, found {actual}"),
        )),
        Some(n) => Err(corrupt(
            path,
            format!(
                "{} trailing bytes after the {n} that dimensions {dims:?} describe",
                actual - n
            ),
        )),
        None => Err(corrupt(path, format!("dimensions {dims:?} overflow"))),
    }
}

#[cfg(test)]
pub fn encode_idx(dims: &[u32], data: &[u8]) -> Vec<u8> {
    let mut out = vec![0, 0, 0x08, dims.len() as u8];
    for d in dims {
        out.extend_from_slice(&d.to_be_bytes());
    }
    out.extend_from_slice(data);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p() -> &'static Path {
        Path::new("x-idx3-ubyte")
    }

    #[test]
    fn parses_a_well_formed_array() {
        let bytes = encode_idx(&[2, 2, 3], &[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]);
        let arr = parse_idx(p(), &bytes).unwrap();
        assert_eq!(arr.dims, vec![2, 2, 3]);
        assert_eq!(arr.data[11], 12);
    }

    #[test]
    fn rejects_truncated_trailing_and_bad_magic() {
        let good = encode_idx(&[2, 3], &[0; 6]);
        let err = parse_idx(p(), &good[..good.len() - 2])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("truncated") && err.contains("x-idx3-ubyte"),
            "{err}"
        );
        let mut long = good.clone();
        long.push(9);
        assert!(
            parse_idx(p(), &long)
                .unwrap_err()
                .to_string()
                .contains("1 trailing bytes")
        );
        let mut bad = good.clone();
        bad[0] = 7;
        assert!(
            parse_idx(p(), &bad)
                .unwrap_err()
                .to_string()
                .contains("bad magic")
        );
        let mut float = good;
        float[2] = 0x0d;
        assert!(
            parse_idx(p(), &float)
                .unwrap_err()
                .to_string()
                .contains("element type 0x0d")
        );
        assert!(
            parse_idx(p(), &[0, 0, 8, 3, 0])
                .unwrap_err()
                .to_string()
                .contains("3 dimensions")
        );
    }

    #[test]
    fn reads_gzip_and_reports_damaged_gzip() {
        use std::io::Write;
        let dir = std::env::temp_dir().join(format!("ddpjob-idx-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("a.gz");
        let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        enc.write_all(&encode_idx(&[3], &[7, 8, 9])).unwrap();
        let gz = enc.finish().unwrap();
        std::fs::write(&path, &gz).unwrap();
        assert_eq!(read_idx(&path).unwrap().data, vec![7, 8, 9]);
        std::fs::write(&path, &gz[..gz.len() / 2]).unwrap();
        let err = read_idx(&path).unwrap_err().to_string();
        assert!(err.contains("gzip") && err.contains("a.gz"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
