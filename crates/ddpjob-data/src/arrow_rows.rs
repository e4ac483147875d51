//! Arrow IPC files as records: what `datasets`' `save_to_disk` writes (a directory with
//! `state.json` naming its `data-0000x-of-0000N.arrow` files, Arrow IPC streams) and
//! `load_dataset("arrow")` reads, `data.dataset = "arrow"`. A path is such a directory, an
//! `.arrow` file (stream or file format), a directory of them or a glob; a `DatasetDict`'s
//! root (`dataset_dict.json`) is refused with its splits named, one of which to give. Read a
//! record batch at a time through Apache Arrow's `arrow-ipc` crate, only the columns asked
//! for decoded, each row handed over as a JSON object as `parquet_rows` hands parquet's. It knows
//! nothing of tokenizers or examples (see `jsonl_index`).

use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use arrow_array::cast::AsArray;
use arrow_array::types::{
    Float32Type, Float64Type, Int8Type, Int16Type, Int32Type, Int64Type, UInt8Type, UInt16Type,
    UInt32Type, UInt64Type,
};
use arrow_array::{Array, RecordBatch, RecordBatchReader};
use arrow_ipc::reader::{FileReader, StreamReader};
use arrow_schema::DataType;
use serde_json::{Map, Value};

use super::DataError;
use super::parquet_rows::files_of;

/// The files `path` names (see the module doc), in the order `datasets` reads them.
pub fn sources(path: &str, key: &str) -> Result<Vec<PathBuf>, DataError> {
    let dir = Path::new(path);
    let bad = |why: String| DataError::Mismatch(format!("data.{key} = \"{path}\": {why}"));
    if dir.join("dataset_dict.json").is_file() {
        let splits = std::fs::read_to_string(dir.join("dataset_dict.json"))
            .ok()
            .and_then(|t| serde_json::from_str::<Value>(&t).ok())
            .and_then(|v| {
                let names = v.get("splits")?.as_array()?.iter();
                Some(
                    names
                        .filter_map(|s| s.as_str().map(String::from))
                        .collect::<Vec<_>>(),
                )
            })
            .unwrap_or_default();
        let first = splits.first().map_or("train", String::as_str);
        return Err(bad(format!(
            "it is a DatasetDict saved by `save_to_disk` (splits: {}); name one split's \
             directory, e.g. data.{key} = \"{}\"",
            splits.join(", "),
            dir.join(first).display()
        )));
    }
    let state = dir.join("state.json");
    if !state.is_file() {
        return files_of(path, key, "arrow");
    }
    let text = std::fs::read_to_string(&state).map_err(|e| bad(format!("`state.json`: {e}")))?;
    let files: Option<Vec<PathBuf>> = serde_json::from_str::<Value>(&text)
        .ok()
        .and_then(|v| v.get("_data_files")?.as_array().cloned())
        .map(|files| {
            (files.iter())
                .filter_map(|f| f.get("filename")?.as_str().map(|n| dir.join(n)))
                .collect()
        });
    match files {
        Some(files) if !files.is_empty() => {
            if let Some(missing) = files.iter().find(|f| !f.is_file()) {
                return Err(bad(format!(
                    "its state.json names `{}`, which is not there: save the dataset again",
                    missing.display()
                )));
            }
            Ok(files)
        }
        _ => Err(bad(
            "its state.json names no data files (`_data_files`): is it a dataset \
             `save_to_disk` wrote?"
                .into(),
        )),
    }
}

/// The user's file, not the job's own: a data error (exit 2).
fn not_arrow(path: &Path, e: impl std::fmt::Display) -> DataError {
    DataError::Mismatch(format!(
        "`{}` is not a readable Arrow IPC file ({e}); check that it is the whole file, as \
         `datasets`' save_to_disk or pyarrow wrote it",
        path.display()
    ))
}

/// The batches of `path` (the stream format, or the file format's `ARROW1` magic), only the
/// columns of `projection` (their indices, in order) when given.
fn batches(
    path: &Path,
    projection: Option<Vec<usize>>,
) -> Result<Box<dyn RecordBatchReader>, DataError> {
    let io = |cause| DataError::Io {
        path: path.into(),
        cause,
    };
    let mut file = File::open(path).map_err(io)?;
    let mut magic = [0u8; 6];
    let is_file = file.read_exact(&mut magic).is_ok() && &magic == b"ARROW1";
    file.seek(SeekFrom::Start(0)).map_err(io)?;
    let reader = BufReader::with_capacity(1 << 20, file);
    Ok(match is_file {
        true => Box::new(FileReader::try_new(reader, projection).map_err(|e| not_arrow(path, e))?),
        false => {
            Box::new(StreamReader::try_new(reader, projection).map_err(|e| not_arrow(path, e))?)
        }
    })
}

/// The names of `path`'s columns.
pub fn columns(path: &Path) -> Result<Vec<String>, DataError> {
    let schema = batches(path, None)?.schema();
    Ok(schema.fields().iter().map(|f| f.name().clone()).collect())
}

/// The bytes `path` holds, for the progress bar.
pub fn size(path: &Path) -> u64 {
    std::fs::metadata(path).map_or(0, |m| m.len())
}

/// Reads `path`'s rows, only the columns of `wanted` it has (at least one, or an error that
/// lists its columns), calling `each` with the row's number (from 1), its values and its
/// share of the file's bytes.
pub fn for_each_row(
    path: &Path,
    wanted: &[&str],
    mut each: impl FnMut(usize, Map<String, Value>, u64) -> Result<(), DataError>,
) -> Result<(), DataError> {
    let schema = batches(path, None)?.schema();
    let picked: Vec<(usize, String)> = (schema.fields().iter().enumerate())
        .filter(|(_, f)| wanted.contains(&f.name().as_str()))
        .map(|(i, f)| (i, f.name().clone()))
        .collect();
    if picked.is_empty() {
        let names: Vec<&str> = schema.fields().iter().map(|f| f.name().as_str()).collect();
        return Err(DataError::Mismatch(format!(
            "`{}` has none of the columns {}; its columns: {} (name yours with \
             data.messages_field, data.text_field, data.prompt_field and \
             data.completion_field)",
            path.display(),
            (wanted.iter().map(|w| format!("\"{w}\"")))
                .collect::<Vec<_>>()
                .join(", "),
            names.join(", ")
        )));
    }
    // Only the columns read are decoded (not a data set's images or audio beside its text).
    let reader = batches(path, Some(picked.iter().map(|(i, _)| *i).collect()))?;
    let mut row = 0;
    for batch in reader {
        let batch: RecordBatch = batch.map_err(|e| not_arrow(path, e))?;
        let share = batch.get_array_memory_size() as u64 / batch.num_rows().max(1) as u64;
        for i in 0..batch.num_rows() {
            row += 1;
            let mut values = Map::new();
            for (column, (_, name)) in picked.iter().enumerate() {
                values.insert(name.clone(), value(batch.column(column).as_ref(), i));
            }
            each(row, values, share)?;
        }
    }
    Ok(())
}

/// Row `i` of `array` as JSON: strings, lists, structs, numbers and booleans (what a data set
/// of text and conversations holds); null for a null and for any other type (a field the
/// records do not read).
fn value(array: &dyn Array, i: usize) -> Value {
    if array.is_null(i) {
        return Value::Null;
    }
    let list = |values: std::sync::Arc<dyn Array>| {
        Value::Array(
            (0..values.len())
                .map(|j| value(values.as_ref(), j))
                .collect(),
        )
    };
    match array.data_type() {
        DataType::Utf8 => array.as_string::<i32>().value(i).into(),
        DataType::LargeUtf8 => array.as_string::<i64>().value(i).into(),
        DataType::Utf8View => array.as_string_view().value(i).into(),
        DataType::List(_) => list(array.as_list::<i32>().value(i)),
        DataType::LargeList(_) => list(array.as_list::<i64>().value(i)),
        DataType::Struct(fields) => {
            let s = array.as_struct();
            Value::Object(
                (fields.iter().zip(s.columns()))
                    .map(|(f, column)| (f.name().clone(), value(column.as_ref(), i)))
                    .collect(),
            )
        }
        DataType::Boolean => array.as_boolean().value(i).into(),
        DataType::Int8 => array.as_primitive::<Int8Type>().value(i).into(),
        DataType::Int16 => array.as_primitive::<Int16Type>().value(i).into(),
        DataType::Int32 => array.as_primitive::<Int32Type>().value(i).into(),
        DataType::Int64 => array.as_primitive::<Int64Type>().value(i).into(),
        DataType::UInt8 => array.as_primitive::<UInt8Type>().value(i).into(),
        DataType::UInt16 => array.as_primitive::<UInt16Type>().value(i).into(),
        DataType::UInt32 => array.as_primitive::<UInt32Type>().value(i).into(),
        DataType::UInt64 => array.as_primitive::<UInt64Type>().value(i).into(),
        DataType::Float32 => f64::from(array.as_primitive::<Float32Type>().value(i)).into(),
        DataType::Float64 => array.as_primitive::<Float64Type>().value(i).into(),
        _ => Value::Null,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(path: &str) -> String {
        let data = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/chat/data");
        data.join(path).display().to_string()
    }

    fn rows(files: &[PathBuf], read: impl Fn(&Path, &mut Vec<Value>)) -> Vec<Value> {
        let mut out = Vec::new();
        for file in files {
            read(file, &mut out);
        }
        out
    }

    /// A saved split is its state.json's files in order; its rows are the JSON the parquet
    /// shards it was saved from give, row for row; a DatasetDict's root names its splits.
    #[test]
    fn a_saved_split_reads_as_the_shards_it_was_saved_from() {
        let files = sources(&fixture("saved/train"), "train_path").unwrap();
        let names: Vec<String> = (files.iter())
            .map(|f| f.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        assert_eq!(
            names,
            ["data-00000-of-00002.arrow", "data-00001-of-00002.arrow"]
        );
        assert_eq!(columns(&files[0]).unwrap(), ["messages"]);
        let saved = rows(&files, |f, out| {
            for_each_row(f, &["messages"], |_, row, _| {
                out.push(Value::Object(row));
                Ok(())
            })
            .unwrap()
        });
        let shards = super::super::parquet_rows::sources(&fixture("train-*.parquet"), "t").unwrap();
        let parquet = rows(&shards, |f, out| {
            super::super::parquet_rows::for_each_row(f, &["messages"], |_, row| {
                out.push(Value::Object(row));
                Ok(())
            })
            .unwrap()
        });
        assert_eq!(saved.len(), 960);
        assert_eq!(saved, parquet);
        let root = sources(&fixture("saved"), "train_path")
            .unwrap_err()
            .to_string();
        assert!(root.contains("(splits: train, test)"), "{root}");
        let none = for_each_row(&files[0], &["text"], |_, _, _| Ok(())).unwrap_err();
        assert!(none.to_string().contains("its columns: messages"), "{none}");
    }
}
