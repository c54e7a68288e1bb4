//! The GPT-2 example as a user meets it, on the CPU with a two-block model: on a
//! learnable token stream (a random walk, each token the last plus one of -3..=3 over a
//! vocabulary of 64: the best loss is ln 7 = 1.95, a model that learned nothing ln 64 =
//! 4.16) the validation loss falls toward ln 7 and AMP bf16 ends within 1% of f32
//! after the same steps; damaged token files stop it with one line naming the file.

mod common;

use std::path::Path;
use std::process::{Command, Output};

use common::{example_binary, ScratchDir};

const VOCAB: u16 = 64;

/// llm.c's token file: 256 i32 (magic, version 1, count), then the u16 tokens.
fn write_tokens(path: &Path, tokens: &[u16], magic: i32) {
    let mut header = [0i32; 256];
    header[0] = magic;
    header[1] = 1;
    header[2] = tokens.len() as i32;
    let mut bytes: Vec<u8> = header.iter().flat_map(|v| v.to_le_bytes()).collect();
    bytes.extend(tokens.iter().flat_map(|t| t.to_le_bytes()));
    std::fs::write(path, bytes).unwrap();
}

fn random_walk(n: usize, seed: u64) -> Vec<u16> {
    let mut state = seed | 1;
    let mut token = 0i64;
    (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            token = (token + (state % 7) as i64 - 3).rem_euclid(VOCAB as i64);
            token as u16
        })
        .collect()
}

fn run(data: &Path, val: Option<&Path>, args: &[&str]) -> Output {
    let mut cmd = Command::new(example_binary("gpt2"));
    cmd.args([
        "--device", "cpu", "--layers", "2", "--heads", "2", "--width", "32",
    ])
    .args([
        "--vocab", "64", "--batch", "8", "--seq", "32", "--lr", "3e-3",
    ])
    .arg("--data")
    .arg(data);
    if let Some(val) = val {
        cmd.arg("--val").arg(val);
    }
    cmd.args(args).output().expect("the gpt2 example runs")
}

/// The last `val loss` the run printed.
fn val_loss(out: &Output) -> f64 {
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().rfind(|l| l.contains("val loss"));
    let line = line.unwrap_or_else(|| panic!("no validation loss in {text}"));
    line.rsplit(' ').next().unwrap().parse().unwrap()
}

#[test]
fn it_learns_a_random_walk_and_bf16_ends_within_one_percent_of_f32() {
    let dir = ScratchDir::new("gpt2-learn");
    let (train, val) = (dir.join("train.bin"), dir.join("val.bin"));
    write_tokens(&train, &random_walk(100_000, 1), 20240520);
    write_tokens(&val, &random_walk(10_000, 2), 20240520);
    let steps = ["--steps", "300", "--print-every", "100"];
    let f32_loss = val_loss(&run(
        &train,
        Some(&val),
        &[&steps[..], &["--precision", "fp32"]].concat(),
    ));
    let bf16_loss = val_loss(&run(
        &train,
        Some(&val),
        &[&steps[..], &["--precision", "bf16"]].concat(),
    ));
    assert!(
        f32_loss < 2.4,
        "f32 validation loss {f32_loss} (ln 7 = 1.95, ln 64 = 4.16)"
    );
    let gap = (bf16_loss - f32_loss).abs() / f32_loss;
    assert!(
        gap < 0.01,
        "bf16 {bf16_loss} vs f32 {f32_loss}: {:.2}%",
        100.0 * gap
    );
}

/// Writes a damaged token file at the path.
type Damage = Box<dyn Fn(&Path)>;

#[test]
fn damaged_token_files_are_one_line_naming_them() {
    let dir = ScratchDir::new("gpt2-bad");
    let cases: [(&str, Damage, &str); 4] = [
        (
            "magic.bin",
            Box::new(|p| write_tokens(p, &random_walk(2000, 3), 1234)),
            "is not llm.c's token file magic",
        ),
        (
            "short.bin",
            Box::new(|p| std::fs::write(p, [0u8; 100]).unwrap()),
            "shorter than the 1024-byte header",
        ),
        (
            "vocab.bin",
            Box::new(|p| write_tokens(p, &[1, 2, 64, 3], 20240520)),
            "token 2 is 64, not below the vocabulary of 64",
        ),
        (
            "truncated.bin",
            Box::new(|p| {
                write_tokens(p, &random_walk(2000, 3), 20240520);
                let bytes = std::fs::read(p).unwrap();
                std::fs::write(p, &bytes[..bytes.len() - 3]).unwrap();
            }),
            "the header counts 2000 tokens but 3997 bytes follow it",
        ),
    ];
    for (name, write, expected) in cases {
        let path = dir.join(name);
        write(&path);
        let out = run(&path, None, &["--steps", "1"]);
        assert_eq!(out.status.code(), Some(2), "{name}: {out:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(err.lines().count(), 1, "{name}: {err}");
        assert!(
            err.contains(name) && err.contains(expected),
            "{name}: {err}"
        );
    }
}
