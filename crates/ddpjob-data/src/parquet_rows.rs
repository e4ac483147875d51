//! Parquet files as records, the way the Hugging Face Hub stores data sets: a path that is a
//! file, a directory of `*.parquet` shards, or a glob of them (`data/train-*.parquet`), read
//! through Apache Arrow's `parquet` crate one row group at a time (memory bounded by a row
//! group, whatever the file's size), only the columns asked for, each row handed over as a
//! JSON object (a `list<struct<role, content>>` column becomes a list of messages). It knows
//! nothing of tokenizers or examples (see `jsonl_index`).

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use parquet::file::reader::{FileReader, SerializedFileReader};
use parquet::schema::types::Type;
use serde_json::{Map, Value};

use super::DataError;

/// The files `path` names: itself, a directory's `*.parquet` files, or a glob's matches (`*`
/// and `?` in the file name), sorted; `key` names the option in errors.
pub fn sources(path: &str, key: &str) -> Result<Vec<PathBuf>, DataError> {
    files_of(path, key, "parquet")
}

/// The files `path` names, as [`sources`] says, with `ext` files (`"parquet"`, `"arrow"`)
/// for a directory's.
pub fn files_of(path: &str, key: &str, ext: &str) -> Result<Vec<PathBuf>, DataError> {
    let p = Path::new(path);
    let missing = |why: String| DataError::Mismatch(format!("data.{key} = \"{path}\": {why}"));
    if p.is_file() {
        return Ok(vec![p.to_path_buf()]);
    }
    let (dir, pattern) = if p.is_dir() {
        (p.to_path_buf(), format!("*.{ext}"))
    } else {
        let name = p.file_name().map(|n| n.to_string_lossy().into_owned());
        match name {
            Some(name) if name.contains(['*', '?']) => {
                let dir = p.parent().filter(|d| !d.as_os_str().is_empty());
                (dir.unwrap_or(Path::new(".")).to_path_buf(), name)
            }
            _ => {
                return Err(missing(format!(
                    "not found: name a {ext} file, a directory of them, or a glob such as \
                     \"data/train-*.{ext}\""
                )));
            }
        }
    };
    if dir.to_string_lossy().contains(['*', '?']) {
        return Err(missing(
            "a glob may match file names only, not directories".into(),
        ));
    }
    let entries =
        std::fs::read_dir(&dir).map_err(|e| missing(format!("`{}`: {e}", dir.display())))?;
    let mut found: Vec<PathBuf> = entries
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|f| f.is_file())
        .filter(|f| (f.file_name()).is_some_and(|n| matches(&pattern, &n.to_string_lossy())))
        .collect();
    found.sort();
    if found.is_empty() {
        return Err(missing(format!(
            "no file in `{}` matches \"{pattern}\"",
            dir.display()
        )));
    }
    Ok(found)
}

/// Whether `name` matches `pattern` (`*`: any run of characters, `?`: one).
fn matches(pattern: &str, name: &str) -> bool {
    let (p, n): (Vec<char>, Vec<char>) = (pattern.chars().collect(), name.chars().collect());
    let (mut pi, mut ni, mut star, mut mark) = (0, 0, None, 0);
    while ni < n.len() {
        if pi < p.len() && (p[pi] == '?' || p[pi] == n[ni]) {
            (pi, ni) = (pi + 1, ni + 1);
        } else if pi < p.len() && p[pi] == '*' {
            (star, mark) = (Some(pi), ni);
            pi += 1;
        } else if let Some(s) = star {
            (pi, mark) = (s + 1, mark + 1);
            ni = mark;
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|&c| c == '*')
}

/// The rows `path` holds, from its footer.
pub fn row_count(path: &Path) -> Result<u64, DataError> {
    let file = File::open(path).map_err(|cause| DataError::Io {
        path: path.into(),
        cause,
    })?;
    let reader = SerializedFileReader::new(file).map_err(|e| not_parquet(path, e))?;
    Ok(reader.metadata().file_metadata().num_rows().max(0) as u64)
}

/// The names of `path`'s top-level columns, from its footer.
pub fn columns(path: &Path) -> Result<Vec<String>, DataError> {
    let file = File::open(path).map_err(|cause| DataError::Io {
        path: path.into(),
        cause,
    })?;
    let reader = SerializedFileReader::new(file).map_err(|e| not_parquet(path, e))?;
    let schema = reader.metadata().file_metadata().schema();
    Ok(schema
        .get_fields()
        .iter()
        .map(|f| f.name().to_string())
        .collect())
}

/// The user's file, not the job's own: a data error (exit 2), as a bad line of jsonl is.
fn not_parquet(path: &Path, e: parquet::errors::ParquetError) -> DataError {
    DataError::Mismatch(format!(
        "`{}` is not a readable parquet file ({e}); check that it is the whole file, as \
         written by pyarrow, datasets or the Hub",
        path.display()
    ))
}

/// Reads `path`'s rows, only the columns of `wanted` it has (at least one, or an error that
/// lists its columns), calling `each` with the row's number (from 1) and its values.
pub fn for_each_row(
    path: &Path,
    wanted: &[&str],
    mut each: impl FnMut(usize, Map<String, Value>) -> Result<(), DataError>,
) -> Result<(), DataError> {
    let corrupt = |e| not_parquet(path, e);
    let file = File::open(path).map_err(|cause| DataError::Io {
        path: path.into(),
        cause,
    })?;
    let reader = SerializedFileReader::new(file).map_err(corrupt)?;
    let schema = reader.metadata().file_metadata().schema();
    let fields: Vec<Arc<Type>> = schema.get_fields().to_vec();
    let picked: Vec<Arc<Type>> = (fields.iter())
        .filter(|f| wanted.contains(&f.name()))
        .cloned()
        .collect();
    if picked.is_empty() {
        let columns: Vec<&str> = fields.iter().map(|f| f.name()).collect();
        return Err(DataError::Mismatch(format!(
            "`{}` has none of the columns {}; its columns: {} (name yours with \
             data.messages_field, data.text_field, data.prompt_field and \
             data.completion_field)",
            path.display(),
            wanted
                .iter()
                .map(|w| format!("\"{w}\""))
                .collect::<Vec<_>>()
                .join(", "),
            columns.join(", ")
        )));
    }
    let projection = Type::group_type_builder(schema.name())
        .with_fields(picked)
        .build()
        .map_err(corrupt)?;
    let rows = reader.get_row_iter(Some(projection)).map_err(corrupt)?;
    for (i, row) in rows.enumerate() {
        let row = row.map_err(corrupt)?;
        let Value::Object(values) = row.to_json_value() else {
            unreachable!("a row is an object")
        };
        each(i + 1, values)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs_match_file_names() {
        assert!(matches("train-*.parquet", "train-00000-of-00002.parquet"));
        assert!(matches("*.parquet", "a.parquet"));
        assert!(matches("t?st", "test"));
        assert!(!matches("train-*.parquet", "test-00000.parquet"));
        assert!(!matches("*.parquet", "a.parquet.tmp"));
        assert!(matches("*", ""));
    }
}
