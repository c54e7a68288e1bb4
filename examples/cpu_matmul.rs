//! CPU matrix product throughput next to numpy (OpenBLAS) in the same run:
//! f32 N×N×N, best of 10 after a warm-up, on every core.
//!
//! `cargo run --release --example cpu_matmul [-- N]`

use std::process::Command;
use std::time::Instant;

use ampgraph::graph::ops::MatMul;
use ampgraph::graph::{DType, Op, Tensor};

const NUMPY: &str = "
import sys, time, numpy as np
n = int(sys.argv[1]); a = np.random.rand(n, n).astype(np.float32); b = np.random.rand(n, n).astype(np.float32)
a @ b
best = min((lambda t: (a @ b, time.perf_counter() - t)[1])(time.perf_counter()) for _ in range(10))
print(2 * n**3 / best / 1e9)
";

fn main() -> std::process::ExitCode {
    ampgraph::cli::main_with(run)
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let n: usize = std::env::args()
        .nth(1)
        .map(|a| {
            a.parse()
                .map_err(|_| format!("the size '{a}' is not a whole number"))
        })
        .transpose()?
        .unwrap_or(2048);
    let values: Vec<f64> = (0..n * n)
        .map(|i| ((i * 7919) % 1000) as f64 / 1000.0)
        .collect();
    let a = Tensor::from_f64(DType::F32, vec![n, n], &values)?;
    let b = a.clone();
    let op = MatMul::default();
    op.eval(&[&a, &b])?;
    let mut best = f64::INFINITY;
    for _ in 0..10 {
        let t = Instant::now();
        op.eval(&[&a, &b])?;
        best = best.min(t.elapsed().as_secs_f64());
    }
    let ours = 2.0 * (n as f64).powi(3) / best / 1e9;
    println!("ampgraph MatMul f32 {n}^3: {ours:.1} GFLOP/s");
    match Command::new("python3")
        .args(["-c", NUMPY, &n.to_string()])
        .output()
    {
        Ok(out) if out.status.success() => {
            let numpy: f64 = String::from_utf8_lossy(&out.stdout).trim().parse()?;
            println!("numpy    matmul f32 {n}^3: {numpy:.1} GFLOP/s");
            println!("ratio ampgraph / numpy: {:.2}", ours / numpy);
        }
        _ => println!("numpy is not available: no comparison"),
    }
    Ok(())
}
