//! PTX that NVRTC compiled, kept on disk so that a new process does not compile the
//! same kernels again (a training script's first step would otherwise spend seconds
//! in NVRTC).
//!
//! An entry is keyed by everything the PTX depends on: the kernel source, the GPU
//! architecture, the NVRTC version and the compile options. The file starts with a
//! header line holding that key and the PTX's length, checked on load; a file that
//! does not match (a collision, a truncated write from another tool) is a miss.
//! Entries are written atomically. The cache is an optimisation only: every failure
//! to read or write it is logged at debug level and otherwise ignored.
//!
//! Where: the executor's [`KernelCache`] setting (`SessionOptions::kernel_cache`,
//! `--kernel-cache DIR|off`); by default `AMPGRAPH_KERNEL_CACHE` (a directory, or
//! `off`), else `$XDG_CACHE_HOME/ampgraph/kernels`, else `$HOME/.cache/ampgraph/kernels`.

use std::path::PathBuf;
use std::str::FromStr;

use ampgraph_graph::format::write_atomic;

const MAGIC: &str = "ampgraph-ptx 1";

/// Where an executor keeps the kernels it compiles.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum KernelCache {
    /// Where the environment says (`AMPGRAPH_KERNEL_CACHE`, else the XDG cache directory).
    #[default]
    FromEnv,
    /// Nowhere: every process compiles its kernels again.
    Off,
    /// In this directory, whatever the environment says.
    Dir(PathBuf),
}

impl FromStr for KernelCache {
    type Err = String;

    /// `off`, or a directory.
    fn from_str(s: &str) -> Result<KernelCache, String> {
        match s {
            "" => Err("the kernel cache must be a directory or 'off'".into()),
            "off" => Ok(KernelCache::Off),
            dir => Ok(KernelCache::Dir(PathBuf::from(dir))),
        }
    }
}

/// The on-disk PTX cache (or none, when disabled or no directory is known).
#[derive(Clone, Debug)]
pub struct DiskCache {
    dir: Option<PathBuf>,
}

impl DiskCache {
    /// The cache the environment asks for.
    pub fn from_env() -> DiskCache {
        DiskCache::resolve(|k| std::env::var(k).ok())
    }

    /// The cache `setting` picks.
    pub fn new(setting: &KernelCache) -> DiskCache {
        match setting {
            KernelCache::FromEnv => DiskCache::from_env(),
            KernelCache::Off => DiskCache { dir: None },
            KernelCache::Dir(dir) => DiskCache::at(dir),
        }
    }

    /// As [`from_env`](Self::from_env), reading variables through `var`.
    pub fn resolve(var: impl Fn(&str) -> Option<String>) -> DiskCache {
        let set = |k: &str| var(k).filter(|v| !v.is_empty());
        let dir = match set("AMPGRAPH_KERNEL_CACHE") {
            Some(v) if v == "off" => None,
            Some(v) => Some(PathBuf::from(v)),
            None => set("XDG_CACHE_HOME")
                .map(PathBuf::from)
                .or_else(|| set("HOME").map(|h| PathBuf::from(h).join(".cache")))
                .map(|base| base.join("ampgraph").join("kernels")),
        };
        DiskCache { dir }
    }

    /// A cache in `dir`.
    pub fn at(dir: impl Into<PathBuf>) -> DiskCache {
        DiskCache {
            dir: Some(dir.into()),
        }
    }

    pub fn dir(&self) -> Option<&PathBuf> {
        self.dir.as_ref()
    }

    /// The PTX stored under the key made of `parts`, if any.
    pub fn load(&self, parts: &[&str]) -> Option<String> {
        let dir = self.dir.as_ref()?;
        let key = key(parts);
        let text = std::fs::read_to_string(dir.join(format!("{key}.ptx"))).ok()?;
        let (header, ptx) = text.split_once('\n')?;
        let want = format!("{MAGIC} {key} {}", ptx.len());
        if header == want {
            Some(ptx.to_string())
        } else {
            log::debug!("kernel cache: ignoring {key}.ptx (header '{header}')");
            None
        }
    }

    /// Stores `ptx` under the key made of `parts`.
    pub fn store(&self, parts: &[&str], ptx: &str) {
        let Some(dir) = &self.dir else { return };
        let key = key(parts);
        let text = format!("{MAGIC} {key} {}\n{ptx}", ptx.len());
        let written = std::fs::create_dir_all(dir)
            .map_err(|e| e.to_string())
            .and_then(|()| {
                write_atomic(&dir.join(format!("{key}.ptx")), text.as_bytes())
                    .map_err(|e| e.to_string())
            });
        if let Err(e) = written {
            log::debug!(
                "kernel cache: could not store {key}.ptx in {}: {e}",
                dir.display()
            );
        }
    }
}

/// A 128-bit FNV-1a hash of `parts` (each followed by a 0 byte), as 32 hex digits:
/// stable across Rust versions and platforms, unlike the standard library's hashers.
fn key(parts: &[&str]) -> String {
    const PRIME: u128 = 0x0000000001000000000000000000013B;
    let mut h: u128 = 0x6c62272e07bb014262b821756295c58d;
    for part in parts {
        for &b in part.as_bytes().iter().chain(&[0u8]) {
            h ^= u128::from(b);
            h = h.wrapping_mul(PRIME);
        }
    }
    format!("{h:032x}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "ampgraph-kernel-cache-{name}-{}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    #[test]
    fn stores_and_finds_ptx_by_everything_it_depends_on() {
        let dir = scratch("roundtrip");
        let cache = DiskCache::at(&dir);
        let parts = [
            "compute_90",
            "13.0",
            "--fmad=false",
            "__global__ void k() {}",
        ];
        assert_eq!(cache.load(&parts), None);
        cache.store(&parts, ".version 8.8\n.target sm_90\n");
        assert_eq!(
            cache.load(&parts).as_deref(),
            Some(".version 8.8\n.target sm_90\n")
        );
        // Another architecture, NVRTC version or source is another entry.
        for other in [
            ["compute_80", parts[1], parts[2], parts[3]],
            [parts[0], "12.4", parts[2], parts[3]],
            [parts[0], parts[1], parts[2], "__global__ void k2() {}"],
        ] {
            assert_eq!(cache.load(&other), None, "{other:?}");
        }
        // Part boundaries count: ("ab", "c") is not ("a", "bc").
        assert_ne!(key(&["ab", "c"]), key(&["a", "bc"]));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_damaged_entry_is_a_miss_not_an_error() {
        let dir = scratch("damaged");
        let cache = DiskCache::at(&dir);
        let parts = ["compute_90", "source"];
        cache.store(&parts, "some ptx text");
        let file = dir.join(format!("{}.ptx", key(&parts)));
        let text = std::fs::read_to_string(&file).unwrap();
        std::fs::write(&file, &text[..text.len() - 3]).unwrap();
        assert_eq!(cache.load(&parts), None, "truncated");
        std::fs::write(&file, "not a cache file").unwrap();
        assert_eq!(cache.load(&parts), None, "no header");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_environment_picks_the_directory_or_turns_it_off() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                pairs
                    .iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| v.to_string())
            }
        };
        let dir = |c: DiskCache| c.dir().cloned();
        assert_eq!(
            dir(DiskCache::resolve(env(&[
                ("AMPGRAPH_KERNEL_CACHE", "/k"),
                ("HOME", "/h")
            ]))),
            Some(PathBuf::from("/k"))
        );
        assert_eq!(
            dir(DiskCache::resolve(env(&[("AMPGRAPH_KERNEL_CACHE", "off")]))),
            None
        );
        assert_eq!(
            dir(DiskCache::resolve(env(&[
                ("XDG_CACHE_HOME", "/x"),
                ("HOME", "/h")
            ]))),
            Some(PathBuf::from("/x/ampgraph/kernels"))
        );
        assert_eq!(
            dir(DiskCache::resolve(env(&[("HOME", "/h")]))),
            Some(PathBuf::from("/h/.cache/ampgraph/kernels"))
        );
        assert_eq!(dir(DiskCache::resolve(env(&[]))), None);
        // A disabled cache stores nothing and finds nothing.
        let off = DiskCache::resolve(env(&[("AMPGRAPH_KERNEL_CACHE", "off")]));
        off.store(&["x"], "ptx");
        assert_eq!(off.load(&["x"]), None);
    }

    #[test]
    fn the_setting_overrides_the_environment() {
        assert_eq!("off".parse(), Ok(KernelCache::Off));
        assert_eq!("/k".parse(), Ok(KernelCache::Dir(PathBuf::from("/k"))));
        assert!("".parse::<KernelCache>().is_err());
        let env = DiskCache::from_env().dir().cloned();
        let chosen = DiskCache::new(&KernelCache::Dir(PathBuf::from("/chosen")));
        assert_eq!(chosen.dir().cloned(), Some(PathBuf::from("/chosen")));
        assert_eq!(DiskCache::new(&KernelCache::Off).dir().cloned(), None);
        assert_eq!(
            DiskCache::new(&KernelCache::FromEnv).dir().cloned(),
            env,
            "the default reads the environment"
        );
    }
}
