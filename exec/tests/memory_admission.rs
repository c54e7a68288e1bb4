//! A step that cannot fit the host's memory is refused before it computes (issue 25):
//! in milliseconds, with the largest tensors named, instead of aborting the process
//! after a minute of work.

use std::time::Instant;

mod common;

use ampgraph_exec::memory_plan;
use ampgraph_exec::{host_memory, CpuExecutor, ExecError, Executor};
use common::{wide_sum, wide_sum_feeds};

#[test]
fn a_step_over_the_memory_limit_is_refused_naming_its_largest_tensors() {
    let (g, sum) = wide_sum(4, 1 << 18); // 1 MiB each
    let mut cpu = CpuExecutor::new();
    cpu.memory_limit = Some(2 << 20);
    let err = cpu.run(&g, &wide_sum_feeds(), &[sum]).unwrap_err();
    let ExecError::Memory(msg) = &err else {
        panic!("{err}")
    };
    assert!(
        msg.contains("MiB of tensors at once but the host has 2.0 MiB"),
        "{msg}"
    );
    assert!(msg.contains("f32[262144] (1.0 MiB)"), "{msg}");
    // Within the limit it runs, to e^0.5 times 4.
    cpu.memory_limit = Some(64 << 20);
    let out = cpu.run(&g, &wide_sum_feeds(), &[sum]).unwrap();
    let want = 4.0 * 0.5f64.exp();
    assert!((out[0].to_f64_vec()[0] - want).abs() < 1e-5);
}

#[test]
fn a_step_larger_than_the_host_fails_in_well_under_a_second() {
    let Some(available) = host_memory::available_bytes() else {
        println!("skipping: this system does not say how much memory it has available");
        return;
    };
    // Tensors of 15 GiB (under the 16 GiB one-tensor limit), twice the memory available.
    let n = 15 << 28; // f32 values
    let k = (2 * available).div_ceil(n * 4).max(2);
    let (g, sum) = wide_sum(k, n);
    let plan = memory_plan::plan(&g, &[sum]).unwrap();
    assert!(
        plan.live_bytes > available,
        "{} <= {available}",
        plan.live_bytes
    );
    let start = Instant::now();
    let err = CpuExecutor::new()
        .run(&g, &wide_sum_feeds(), &[sum])
        .unwrap_err();
    assert!(start.elapsed().as_secs_f64() < 1.0, "{:?}", start.elapsed());
    let msg = err.to_string();
    assert!(
        msg.starts_with("out of memory: ") && msg.contains("15360.0 MiB"),
        "{msg}"
    );
}
