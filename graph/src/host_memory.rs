//! How much host memory a run may still take: Linux's `MemAvailable`, lowered to what
//! the process's cgroup (v2) allows beyond what it uses, as containers limit it, and to
//! what its address-space limit (`ulimit -v`, RLIMIT_AS) leaves. Everything that sizes
//! an allocation from its input (import folding a constant, a seeded feed, a step's
//! plan) checks against it first: an allocation past it aborts the process.

use std::path::Path;

/// Bytes in MiB.
pub fn mib(bytes: usize) -> f64 {
    bytes as f64 / (1u64 << 20) as f64
}

/// Bytes the host can still give this process, where the system says (Linux); `None`
/// elsewhere.
pub fn available_bytes() -> Option<usize> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let mut available = mem_available(&meminfo)?;
    if let Some(headroom) = cgroup_headroom(Path::new("/sys/fs/cgroup")) {
        available = available.min(headroom);
    }
    let limits = std::fs::read_to_string("/proc/self/limits").ok();
    let status = std::fs::read_to_string("/proc/self/status").ok();
    if let Some(left) = address_space_left(limits.as_deref(), status.as_deref()) {
        available = available.min(left);
    }
    Some(available)
}

/// The soft address-space limit (`Max address space` of `/proc/self/limits`) less the
/// process's `VmSize` (`/proc/self/status`), where there is a limit.
fn address_space_left(limits: Option<&str>, status: Option<&str>) -> Option<usize> {
    let line = limits?
        .lines()
        .find(|l| l.starts_with("Max address space"))?;
    let limit: usize = line.split_whitespace().nth(3)?.parse().ok()?; // "unlimited": none
    let used = status?.lines().find(|l| l.starts_with("VmSize:"))?;
    let kib: usize = used.split_whitespace().nth(1)?.parse().ok()?;
    Some(limit.saturating_sub(kib.saturating_mul(1024)))
}

/// `MemAvailable` of a `/proc/meminfo` text, in bytes.
fn mem_available(meminfo: &str) -> Option<usize> {
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// The cgroup's `memory.max` less its `memory.current`, where it has a limit.
fn cgroup_headroom(dir: &Path) -> Option<usize> {
    let read = |name: &str| std::fs::read_to_string(dir.join(name)).ok();
    let max: usize = read("memory.max")?.trim().parse().ok()?; // "max": no limit
    let current: usize = read("memory.current")?.trim().parse().ok()?;
    Some(max.saturating_sub(current))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mem_available_is_read_in_bytes() {
        let text = "MemTotal:       24576000 kB\nMemFree:  1000 kB\nMemAvailable:   20000000 kB\n";
        assert_eq!(mem_available(text), Some(20_000_000 * 1024));
        assert_eq!(mem_available("MemTotal: 5 kB\n"), None);
    }

    #[test]
    fn an_address_space_limit_lowers_the_headroom() {
        let limits = "Limit Soft Hard Units\nMax address space         8000000000           unlimited            bytes\n";
        let status = "Name: x\nVmSize:\t 1000000 kB\n";
        assert_eq!(
            address_space_left(Some(limits), Some(status)),
            Some(8_000_000_000 - 1_024_000_000)
        );
        let unlimited =
            "Max address space         unlimited            unlimited            bytes\n";
        assert_eq!(address_space_left(Some(unlimited), Some(status)), None);
        assert_eq!(address_space_left(None, Some(status)), None);
    }

    #[test]
    fn a_cgroup_limit_lowers_the_headroom() {
        let dir = std::env::temp_dir().join(format!("ampgraph-cgroup-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("memory.max"), "1000000\n").unwrap();
        std::fs::write(dir.join("memory.current"), "250000\n").unwrap();
        assert_eq!(cgroup_headroom(&dir), Some(750_000));
        std::fs::write(dir.join("memory.max"), "max\n").unwrap();
        assert_eq!(cgroup_headroom(&dir), None);
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(available_bytes().is_none_or(|b| b > 0));
    }
}
