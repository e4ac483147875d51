//! The MNIST download path against an HTTP server on 127.0.0.1 serving IDX files the test writes.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::sync::Arc;
use std::thread;

use sha2::{Digest, Sha256};

use crate::common::TestJob;

const FILES: [&str; 4] = [
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
];

fn idx(dims: &[u32], data: &[u8]) -> Vec<u8> {
    let mut out = vec![0, 0, 8, dims.len() as u8];
    dims.iter()
        .for_each(|d| out.extend_from_slice(&d.to_be_bytes()));
    out.extend_from_slice(data);
    out
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    enc.write_all(bytes).unwrap();
    enc.finish().unwrap()
}

/// A tiny MNIST-shaped dataset: 64 train and 32 test images of 28×28, classes 0..4.
fn tiny_mnist() -> HashMap<String, Vec<u8>> {
    let image = |i: usize| -> Vec<u8> {
        (0..784)
            .map(|p| if p % 5 == i % 5 { 200 } else { 10 })
            .collect()
    };
    let (train, test) = (64, 32);
    let images = |n: usize| {
        idx(
            &[n as u32, 28, 28],
            &(0..n).flat_map(image).collect::<Vec<_>>(),
        )
    };
    let labels = |n: usize| {
        idx(
            &[n as u32],
            &(0..n).map(|i| (i % 5) as u8).collect::<Vec<_>>(),
        )
    };
    [images(train), labels(train), images(test), labels(test)]
        .into_iter()
        .zip(FILES)
        .map(|(bytes, name)| (format!("{name}.gz"), gzip(&bytes)))
        .collect()
}

/// Serves `files` at /<name> until the test process ends; returns the base URL.
fn serve(files: HashMap<String, Vec<u8>>) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let files = Arc::new(files);
    thread::spawn(move || {
        for stream in listener.incoming().take(64) {
            let Ok(mut stream) = stream else { continue };
            let mut request = String::new();
            let mut reader = BufReader::new(stream.try_clone().unwrap());
            reader.read_line(&mut request).ok();
            let mut header = String::new();
            while reader
                .read_line(&mut header)
                .map(|n| n > 2)
                .unwrap_or(false)
            {
                header.clear();
            }
            let path = request
                .split_whitespace()
                .nth(1)
                .unwrap_or("/")
                .trim_start_matches('/');
            match files.get(path) {
                Some(body) => {
                    let head = format!(
                        "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                        body.len()
                    );
                    let _ = stream
                        .write_all(head.as_bytes())
                        .and_then(|_| stream.write_all(body));
                }
                None => {
                    let _ = stream.write_all(
                        b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
                    );
                }
            }
        }
    });
    url
}

fn sha256(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn config(mirrors: &[String], checksums: &HashMap<String, String>) -> String {
    let sums: Vec<String> = checksums
        .iter()
        .map(|(k, v)| format!("\"{k}\" = \"{v}\""))
        .collect();
    let mirrors: Vec<String> = mirrors.iter().map(|m| format!("\"{m}\"")).collect();
    format!(
        "[data]\ndataset = \"mnist\"\nroot = \"data/mnist\"\ndownload = true\nmirrors = [{}]\n\n[data.checksums]\n{}\n\n\
         [model]\narch = \"mlp\"\nhidden = [16]\n[train]\nepochs = 2\nbatch_size = 16\nlr = 0.01\n",
        mirrors.join(", "),
        sums.join("\n")
    )
}

fn files_in(dir: &std::path::Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .map(|d| {
            d.map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn downloads_verifies_and_trains_then_reuses_the_files() {
    let files = tiny_mnist();
    let sums = files.iter().map(|(k, v)| (k.clone(), sha256(v))).collect();
    // The first mirror has nothing (404); the second serves the files.
    let mirrors = vec![serve(HashMap::new()), serve(files.clone())];
    let t = TestJob::new();
    let cfg = t.config("dl", &config(&mirrors, &sums));
    let run = t.run(&cfg, &[]);
    run.success();
    // Each file says where it comes from, and why the first mirror was passed over.
    let first = format!("{}/train-images-idx3-ubyte.gz", mirrors[0]);
    assert!(
        run.stdout.contains(&format!(
            "downloading train-images-idx3-ubyte.gz from {first} ..."
        )) && run.stdout.contains(&format!("  {first}: "))
            && run.stdout.contains("; trying the next mirror"),
        "{}",
        run.stdout
    );
    let mut stored = files_in(&t.path("data/mnist"));
    stored.sort();
    assert_eq!(
        stored,
        vec![
            "t10k-images-idx3-ubyte.gz",
            "t10k-labels-idx1-ubyte.gz",
            "train-images-idx3-ubyte.gz",
            "train-labels-idx1-ubyte.gz"
        ]
    );
    for (name, bytes) in &files {
        assert_eq!(
            &std::fs::read(t.path("data/mnist").join(name)).unwrap(),
            bytes
        );
    }
    let summary = t.json(&t.job("dl").join("summary.json"));
    assert!(
        summary["test_accuracy"].as_f64().unwrap() > 0.5,
        "{summary}"
    );

    // Offline now (no mirror answers): the files already in data.root are used.
    let offline = config(&["http://127.0.0.1:9".to_string()], &sums);
    t.run(&t.config("again", &offline), &["--name", "again"])
        .success();
}

#[test]
fn a_checksum_mismatch_is_an_error_and_leaves_no_file() {
    let files = tiny_mnist();
    let mut sums: HashMap<String, String> =
        files.iter().map(|(k, v)| (k.clone(), sha256(v))).collect();
    sums.insert("train-images-idx3-ubyte.gz".into(), "0".repeat(64));
    let t = TestJob::new();
    let cfg = t.config("bad", &config(&[serve(files)], &sums));
    t.run(&cfg, &[])
        .fails_with(1, "SHA-256 mismatch")
        .fails_with(1, "train-images-idx3-ubyte.gz");
    assert!(
        files_in(&t.path("data/mnist")).is_empty(),
        "left behind: {:?}",
        files_in(&t.path("data/mnist"))
    );
    assert!(
        !t.job("bad").exists(),
        "a job that could not load its data must not leave a job directory"
    );
}

#[test]
fn a_server_that_is_down_gives_a_clear_error() {
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let t = TestJob::new();
    let cfg = t.config(
        "down",
        &config(&[format!("http://127.0.0.1:{port}")], &HashMap::new()),
    );
    t.run(&cfg, &[])
        .fails_with(1, "could not download train-images-idx3-ubyte.gz")
        .fails_with(1, "every mirror failed");
    assert!(files_in(&t.path("data/mnist")).is_empty());
}

#[test]
fn offline_without_data_says_where_it_looked() {
    let t = TestJob::new();
    let cfg = t.config(
        "nodata",
        "[data]\ndataset = \"mnist\"\nroot = \"nowhere\"\n",
    );
    t.run(&cfg, &[])
        .fails_with(1, "missing train-images-idx3-ubyte")
        .fails_with(1, "nowhere")
        .fails_with(1, "/usr/share/datasets/mnist")
        .fails_with(1, "data.download = true");
}

#[test]
fn a_truncated_idx_file_is_named() {
    let t = TestJob::new();
    let root = t.path("data/mnist");
    std::fs::create_dir_all(&root).unwrap();
    for (name, bytes) in tiny_mnist() {
        let raw = {
            use std::io::Read;
            let mut out = Vec::new();
            flate2::read::GzDecoder::new(bytes.as_slice())
                .read_to_end(&mut out)
                .unwrap();
            out
        };
        let keep = if name.starts_with("t10k-images") {
            raw.len() - 100
        } else {
            raw.len()
        };
        std::fs::write(root.join(name.trim_end_matches(".gz")), &raw[..keep]).unwrap();
    }
    let cfg = t.config(
        "trunc",
        "[data]\ndataset = \"mnist\"\nroot = \"data/mnist\"\n",
    );
    t.run(&cfg, &[])
        .fails_with(1, "t10k-images-idx3-ubyte` is damaged: truncated");
}

/// `validate` counts the training samples in the files it finds (never downloading), and says
/// when it assumes the standard split because they are not there yet.
#[test]
fn validate_counts_the_samples_of_the_files_on_disk() {
    let t = TestJob::new();
    let root = t.path("data/mnist");
    std::fs::create_dir_all(&root).unwrap();
    for (name, bytes) in tiny_mnist() {
        std::fs::write(root.join(name), bytes).unwrap();
    }
    let text = format!(
        "[data]\ndataset = \"mnist\"\nroot = \"{}\"\n",
        root.display()
    );
    let cfg = t.config("job", &text);
    let out = t.ddpjob(&["validate", &cfg.to_string_lossy()]);
    out.success();
    assert!(
        out.stdout
            .contains("train_samples     = 64  (counted in the files)"),
        "{}",
        out.stdout
    );

    let empty = t.path("nothing");
    let text = format!(
        "[data]\ndataset = \"mnist\"\nroot = \"{}\"\ndownload = true\n",
        empty.display()
    );
    let out = t.ddpjob(&["validate", &t.config("absent", &text).to_string_lossy()]);
    out.success();
    assert!(
        out.stdout.contains(
            "60000  (the standard split; its files are not on disk yet (`run` downloads them))"
        ),
        "{}",
        out.stdout
    );
    assert!(!empty.exists(), "validate downloaded or created something");
    // Without downloads, nothing will fetch them: said so, not "yet".
    let offline = text.replace("download = true", "download = false");
    let out = t.ddpjob(&["validate", &t.config("offline", &offline).to_string_lossy()]);
    assert!(
        out.stdout
            .contains("not on disk, and data.download = false: `run` will not find them"),
        "{}",
        out.stdout
    );
}
