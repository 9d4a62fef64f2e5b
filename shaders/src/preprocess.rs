//! A small preprocessor: the one way a kernel is specialised.
//!
//! Why not WGSL `override` constants: a specialisation here changes *types* (f32 weights, f16
//! pairs packed in `u32`, native `f16` behind `enable f16;`) and the sizes of private and
//! workgroup arrays (`HEAD_DIM`, `CHUNK`), which overrides cannot do portably; and with plain
//! constants the module handed to naga's MSL and SPIR-V writers needs no override pass.
//!
//! Syntax, on lines of their own (leading spaces allowed):
//! `#if COND`, `#elif COND`, `#else`, `#endif`, nestable, where `COND` is `NAME`
//! (defined and non-zero), `NAME == N` or `NAME != N`. Every define is also emitted at the end
//! of the module as `const NAME: u32 = N;` (WGSL module-scope declarations may come in any
//! order), so sources use `HEAD_DIM` or `WG` directly in array sizes and `@workgroup_size`.

use std::collections::BTreeMap;
use std::fmt;

/// The defines of one specialisation: name -> value. Ordered, so its `key()` is canonical.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Spec(pub BTreeMap<String, u32>);

impl Spec {
    pub fn new() -> Spec {
        Spec::default()
    }

    /// This spec with `name = value` added (or replaced).
    pub fn with(mut self, name: &str, value: u32) -> Spec {
        self.0.insert(name.to_string(), value);
        self
    }

    pub fn get(&self, name: &str) -> Option<u32> {
        self.0.get(name).copied()
    }

    /// `NAME=v,NAME=v` in name order: a pipeline-cache key and a file-name part.
    pub fn key(&self) -> String {
        let parts: Vec<String> = self.0.iter().map(|(k, v)| format!("{k}={v}")).collect();
        parts.join(",")
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PreprocessError {
    pub line: usize,
    pub message: String,
}

impl fmt::Display for PreprocessError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "line {}: {}", self.line, self.message)
    }
}

impl std::error::Error for PreprocessError {}

/// One open `#if` block.
struct Frame {
    /// The enclosing block emits lines.
    parent_on: bool,
    /// Some branch of this block has been taken already.
    taken: bool,
    /// The current branch emits lines.
    on: bool,
}

fn eval(cond: &str, spec: &Spec, line: usize) -> Result<bool, PreprocessError> {
    let err = |message: String| PreprocessError { line, message };
    let parts: Vec<&str> = cond.split_whitespace().collect();
    match parts.as_slice() {
        [name] => Ok(spec.get(name).is_some_and(|v| v != 0)),
        [name, op, value] => {
            let v = spec
                .get(name)
                .ok_or_else(|| err(format!("`{name}` is not defined")))?;
            let n: u32 = value
                .parse()
                .map_err(|_| err(format!("`{value}` is not a number")))?;
            match *op {
                "==" => Ok(v == n),
                "!=" => Ok(v != n),
                _ => Err(err(format!("unknown operator `{op}`"))),
            }
        }
        _ => Err(err(format!("cannot read condition `{cond}`"))),
    }
}

/// Expand `source` for `spec`. Lines of skipped branches become empty lines, so naga's error
/// line numbers still point into the `.wgsl` file.
pub fn preprocess(source: &str, spec: &Spec) -> Result<String, PreprocessError> {
    let mut out = String::with_capacity(source.len() + 64 * spec.0.len());
    let mut stack: Vec<Frame> = Vec::new();
    let on = |stack: &[Frame]| stack.last().is_none_or(|f| f.on);
    for (i, text) in source.lines().enumerate() {
        let line = i + 1;
        let trimmed = text.trim_start();
        let err = |message: &str| PreprocessError {
            line,
            message: message.to_string(),
        };
        if let Some(cond) = trimmed.strip_prefix("#if ") {
            let parent_on = on(&stack);
            let c = parent_on && eval(cond, spec, line)?;
            stack.push(Frame {
                parent_on,
                taken: c,
                on: c,
            });
        } else if let Some(cond) = trimmed.strip_prefix("#elif ") {
            let f = stack.last_mut().ok_or_else(|| err("#elif without #if"))?;
            let c = f.parent_on && !f.taken && eval(cond, spec, line)?;
            f.on = c;
            f.taken |= c;
        } else if trimmed.starts_with("#else") {
            let f = stack.last_mut().ok_or_else(|| err("#else without #if"))?;
            f.on = f.parent_on && !f.taken;
            f.taken = true;
        } else if trimmed.starts_with("#endif") {
            stack.pop().ok_or_else(|| err("#endif without #if"))?;
        } else if trimmed.starts_with('#') {
            return Err(err("unknown directive"));
        } else if on(&stack) {
            out.push_str(text);
        }
        out.push('\n');
    }
    if !stack.is_empty() {
        return Err(PreprocessError {
            line: source.lines().count(),
            message: "#if without #endif".into(),
        });
    }
    for (name, value) in &spec.0 {
        out.push_str(&format!("const {name}: u32 = {value}u;\n"));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn branches_nest_and_defines_become_constants() {
        let src =
            "a\n#if W == 1\nb\n#if X\nc\n#else\nd\n#endif\n#elif W == 2\ne\n#else\nf\n#endif\ng";
        let spec = Spec::new().with("W", 1).with("X", 0);
        let out = preprocess(src, &spec).unwrap();
        let code: Vec<&str> = out.lines().filter(|l| !l.is_empty()).collect();
        assert_eq!(
            code,
            [
                "a",
                "b",
                "d",
                "g",
                "const W: u32 = 1u;",
                "const X: u32 = 0u;"
            ]
        );
        let out = preprocess(src, &Spec::new().with("W", 3).with("X", 1)).unwrap();
        let code: Vec<&str> = out.lines().filter(|l| !l.is_empty()).collect();
        assert_eq!(code[..3], ["a", "f", "g"]);
    }

    #[test]
    fn bad_directives_are_errors() {
        assert!(preprocess("#if\n#endif", &Spec::new()).is_err());
        assert!(preprocess("#if W == 1\n", &Spec::new().with("W", 1)).is_err());
        assert!(preprocess("#endif", &Spec::new()).is_err());
        assert!(preprocess("#if Y == 1\n#endif", &Spec::new()).is_err());
        assert!(preprocess("#include x", &Spec::new()).is_err());
    }
}
