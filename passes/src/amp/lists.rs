//! Precision lists: which ops are always worth running in 16 bits (allow), which
//! follow their inputs (infer), which follow their neighbours (clear) and which are
//! numerically unsafe (deny). Profiles live in `allowlists/*.toml` (docs/design.md §4).

use std::collections::BTreeMap;
use std::fmt;

use serde::Deserialize;

use crate::PassError;

/// The class of an op in the lists.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ListClass {
    Allow,
    Infer,
    Clear,
    Deny,
}

impl ListClass {
    pub const ALL: [ListClass; 4] = [
        ListClass::Allow,
        ListClass::Infer,
        ListClass::Clear,
        ListClass::Deny,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ListClass::Allow => "allow",
            ListClass::Infer => "infer",
            ListClass::Clear => "clear",
            ListClass::Deny => "deny",
        }
    }

    /// The environment variable stem of this list, as in TensorFlow's overrides.
    fn env_stem(self) -> &'static str {
        match self {
            ListClass::Allow => "AMPGRAPH_AMP_ALLOWLIST",
            ListClass::Infer => "AMPGRAPH_AMP_INFERLIST",
            ListClass::Clear => "AMPGRAPH_AMP_CLEARLIST",
            ListClass::Deny => "AMPGRAPH_AMP_DENYLIST",
        }
    }
}

impl fmt::Display for ListClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The built-in profiles, compiled in so the binary works from any directory.
const PROFILES: &[(&str, &str)] = &[
    (
        "default_fp16",
        include_str!("../../../allowlists/default_fp16.toml"),
    ),
    (
        "default_bf16",
        include_str!("../../../allowlists/default_bf16.toml"),
    ),
    (
        "tensorflow",
        include_str!("../../../allowlists/tensorflow.toml"),
    ),
];

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ListFile {
    /// Optional so that a file of `[keep_f32]` alone (saved by calibration) parses.
    #[serde(default)]
    lists: ListTables,
    /// Nodes kept in f32 whatever their op's class, with why (`"node" = "reason"`):
    /// what calibration and bisection find for one model.
    #[serde(default)]
    keep_f32: BTreeMap<String, String>,
}

#[derive(Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct ListTables {
    #[serde(default)]
    allow: Vec<String>,
    #[serde(default)]
    infer: Vec<String>,
    #[serde(default)]
    clear: Vec<String>,
    #[serde(default)]
    deny: Vec<String>,
}

/// Op name -> class. Ops in no list stay in f32 and stop every propagation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PrecisionLists {
    classes: BTreeMap<String, ListClass>,
    /// Nodes (by name) painted as denylisted whatever their op, with the reason
    /// `explain` gives.
    keep_f32: BTreeMap<String, String>,
}

impl PrecisionLists {
    /// A built-in profile: `default_fp16`, `default_bf16` or `tensorflow`.
    pub fn profile(name: &str) -> Result<Self, PassError> {
        let (_, text) = PROFILES.iter().find(|(n, _)| *n == name).ok_or_else(|| {
            let names: Vec<&str> = PROFILES.iter().map(|(n, _)| *n).collect();
            PassError::Lists(format!(
                "unknown list profile '{name}' (known: {})",
                names.join(", ")
            ))
        })?;
        Self::from_toml(text, name)
    }

    /// Parses a list file; `origin` names it in errors.
    pub fn from_toml(text: &str, origin: &str) -> Result<Self, PassError> {
        let file: ListFile =
            toml::from_str(text).map_err(|e| PassError::Lists(format!("{origin}: {e}")))?;
        let mut lists = PrecisionLists {
            classes: BTreeMap::new(),
            keep_f32: file.keep_f32,
        };
        let tables = [
            (ListClass::Allow, file.lists.allow),
            (ListClass::Infer, file.lists.infer),
            (ListClass::Clear, file.lists.clear),
            (ListClass::Deny, file.lists.deny),
        ];
        for (class, ops) in tables {
            for op in ops {
                check_op(&op, origin)?;
                if let Some(prev) = lists.classes.insert(op.clone(), class) {
                    return Err(PassError::Lists(format!(
                        "{origin}: op '{op}' is in both the {prev} and the {class} list"
                    )));
                }
            }
        }
        Ok(lists)
    }

    /// Loads a list file from disk.
    pub fn from_file(path: &std::path::Path) -> Result<Self, PassError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| PassError::Lists(format!("{}: {e}", path.display())))?;
        Self::from_toml(&text, &path.display().to_string())
    }

    pub fn class(&self, op: &str) -> Option<ListClass> {
        self.classes.get(op).copied()
    }

    /// Keeps node `name` in f32 whatever its op, as a denylisted node (its f32 spreads
    /// as a deny op's does); `reason` is what `explain` says of it.
    pub fn keep_f32(&mut self, name: &str, reason: impl Into<String>) {
        self.keep_f32.insert(name.to_string(), reason.into());
    }

    /// Why node `name` is kept in f32 by [`keep_f32`](Self::keep_f32), if it is.
    pub fn kept_f32(&self, name: &str) -> Option<&str> {
        self.keep_f32.get(name).map(String::as_str)
    }

    /// Every node kept in f32 by name, with its reason.
    pub fn nodes_kept_f32(&self) -> &BTreeMap<String, String> {
        &self.keep_f32
    }

    /// Moves `op` into `class` (out of any other list).
    pub fn add(&mut self, class: ListClass, op: &str) -> Result<(), PassError> {
        check_op(op, "list override")?;
        self.classes.insert(op.to_string(), class);
        Ok(())
    }

    /// Takes `op` out of `class`; it then belongs to no list.
    pub fn remove(&mut self, class: ListClass, op: &str) -> Result<(), PassError> {
        check_op(op, "list override")?;
        if self.classes.get(op) == Some(&class) {
            self.classes.remove(op);
        }
        Ok(())
    }

    /// Applies `AMPGRAPH_AMP_{ALLOW,INFER,CLEAR,DENY}LIST_{ADD,REMOVE}` (comma-separated op
    /// names), read through `var` so tests and the library API can supply their own.
    pub fn apply_overrides(
        &mut self,
        var: impl Fn(&str) -> Option<String>,
    ) -> Result<(), PassError> {
        for class in ListClass::ALL {
            for (suffix, add) in [("REMOVE", false), ("ADD", true)] {
                let key = format!("{}_{suffix}", class.env_stem());
                let Some(value) = var(&key) else { continue };
                for op in value.split(',').map(str::trim).filter(|s| !s.is_empty()) {
                    if add {
                        self.add(class, op)
                    } else {
                        self.remove(class, op)
                    }
                    .map_err(|e| PassError::Lists(format!("{key}: {e}")))?;
                }
            }
        }
        Ok(())
    }

    /// The ops of one class, sorted.
    pub fn ops(&self, class: ListClass) -> Vec<&str> {
        self.classes
            .iter()
            .filter(|(_, c)| **c == class)
            .map(|(op, _)| op.as_str())
            .collect()
    }
}

/// A list file of nodes kept in f32 alone (`[keep_f32]`, `"node" = "reason"`): what
/// calibration and bisection save, read back by [`PrecisionLists::from_toml`].
pub fn keep_f32_toml(nodes: &BTreeMap<String, String>) -> Result<String, PassError> {
    #[derive(serde::Serialize)]
    struct KeepFile<'a> {
        keep_f32: &'a BTreeMap<String, String>,
    }
    toml::to_string(&KeepFile { keep_f32: nodes })
        .map_err(|e| PassError::Lists(format!("cannot write the [keep_f32] table: {e}")))
}

fn check_op(op: &str, origin: &str) -> Result<(), PassError> {
    if ampgraph_graph::ops::is_known_op(op) {
        Ok(())
    } else {
        Err(PassError::Lists(format!("{origin}: unknown op '{op}'")))
    }
}
