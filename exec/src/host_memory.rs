//! How much host memory a run may still take: Linux's `MemAvailable`, lowered to what
//! the process's cgroup (v2) allows beyond what it uses, as containers limit it.

use std::path::Path;

/// Bytes the host can still give this process, where the system says (Linux); `None`
/// elsewhere.
pub fn available_bytes() -> Option<usize> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let available = mem_available(&meminfo)?;
    Some(match cgroup_headroom(Path::new("/sys/fs/cgroup")) {
        Some(headroom) => available.min(headroom),
        None => available,
    })
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
