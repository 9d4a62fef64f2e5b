//! Builds the browser tab's helper page, and the WebAssembly module the split page's simulator
//! shares with it, into `tether`: `tether serve` and `--accept-helpers` then serve the page at
//! /helper/ with no files beside the binary, as llama.cpp's server does its page. The module
//! is checked in (wasm-demo/www/pkg, which scripts/build-wasm.sh rebuilds and CI checks against
//! the sources), so a plain `cargo build` has it; a source tree without it (deleted, or a
//! partial copy) builds a `tether` whose /helper/ says how to get it, and a warning says so
//! here. Cargo runs this again whenever wasm-demo/www changes.

use std::path::{Path, PathBuf};

/// The page's files, relative to wasm-demo/www.
const FILES: &[&str] = &[
    "helper.html",
    "helper.js",
    "pkg/wasm_demo.js",
    "pkg/wasm_demo_bg.wasm",
];

fn main() {
    let www = Path::new(env!("CARGO_MANIFEST_DIR")).join("../wasm-demo/www");
    println!("cargo:rerun-if-changed={}", www.display());
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let all_there = FILES.iter().all(|f| www.join(f).is_file());
    let code = if all_there {
        let entries: Vec<String> = FILES
            .iter()
            .map(|f| {
                let path = www.join(f).canonicalize().expect("the file exists");
                format!(
                    "    ({f:?}, include_bytes!({:?})),",
                    path.display().to_string()
                )
            })
            .collect();
        format!(
            "/// The helper page's files, by path under /helper/.\n\
             pub const PAGE: Option<&[(&str, &[u8])]> = Some(&[\n{}\n]);\n",
            entries.join("\n")
        )
    } else {
        println!(
            "cargo:warning=wasm-demo/www/pkg (checked in; scripts/build-wasm.sh rebuilds it) is \
             missing: this tether answers /helper/ and the simulator's module with 404"
        );
        "/// The helper page's files: missing when tether was built (wasm-demo/www/pkg).\n\
         pub const PAGE: Option<&[(&str, &[u8])]> = None;\n"
            .to_string()
    };
    std::fs::write(out.join("page.rs"), code).expect("OUT_DIR is writable");
}
