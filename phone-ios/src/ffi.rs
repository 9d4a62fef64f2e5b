//! The iOS library's C ABI (include/tether_helper.h, written once and compiled against in
//! tests/c_abi.rs): start a helper from a JSON config on a thread of its own, read what it is
//! doing as JSON, stop it. An app (phone-ios/app) calls these; so can any C caller.
//!
//! The config's keys are `tether-helper`'s flags (`{"model": "tiny", "join": "ws://…",
//! "pair": "215-770", "mem-budget": "2G"}`; `_` may stand for `-`): a string or number is the
//! flag's value, `true` gives the flag alone, `false` and `null` leave it out. The command line's
//! own parser checks them, so the two cannot drift apart. On iOS a config without `mem-budget`
//! offers half of what `os_proc_available_memory` says the app may still use. `"backend":
//! "metal"` computes on Metal itself; it is not the default while it has never run on a device
//! (docs/PHONE.md).

use std::ffi::{c_char, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::thread::JoinHandle;

use clap::Parser;
use serde_json::Value;

use engine_core::helper::runner::{self, Control, Options};

/// A running helper (opaque to C).
pub struct TetherHelper {
    control: Arc<Control>,
    thread: Option<JoinHandle<()>>,
}

#[derive(Parser)]
#[command(name = "tether-helper")]
struct Config {
    #[command(flatten)]
    helper: Options,
}

/// The config as `tether-helper`'s arguments.
fn arguments(config: &str) -> Result<Vec<String>, String> {
    let object = match serde_json::from_str::<Value>(config) {
        Ok(Value::Object(o)) => o,
        Ok(_) => return Err("the config must be a JSON object".into()),
        Err(e) => return Err(format!("the config is not JSON: {e}")),
    };
    let mut args = vec!["tether-helper".to_string()];
    if !object.contains_key("mem-budget") && !object.contains_key("mem_budget") {
        if let Some(budget) = device_budget() {
            args.extend(["--mem-budget".into(), budget.to_string()]);
        }
    }
    for (key, value) in object {
        let flag = format!("--{}", key.replace('_', "-"));
        match value {
            Value::String(s) => args.extend([flag, s]),
            Value::Number(n) => args.extend([flag, n.to_string()]),
            Value::Bool(true) => args.push(flag),
            Value::Bool(false) | Value::Null => {}
            other => return Err(format!("`{key}`: {other} is not a flag's value")),
        }
    }
    Ok(args)
}

/// Half the memory this app may still allocate (iOS 13 and later).
#[cfg(target_os = "ios")]
fn device_budget() -> Option<u64> {
    extern "C" {
        fn os_proc_available_memory() -> usize;
    }
    // SAFETY: a libSystem function without arguments that only reads the process's limit.
    let available = unsafe { os_proc_available_memory() } as u64;
    (available > 0).then_some(available / 2)
}

#[cfg(not(target_os = "ios"))]
fn device_budget() -> Option<u64> {
    None
}

fn start(config: &str) -> Result<TetherHelper, String> {
    let args = arguments(config)?;
    let options = Config::try_parse_from(args)
        .map_err(|e| e.to_string())?
        .helper;
    let control = Arc::new(Control::default());
    let running = control.clone();
    let thread = std::thread::Builder::new()
        .name("tether-helper".into())
        .spawn(move || {
            // The outcome is in the status; a panic is reported there too, not across the ABI.
            let ran = catch_unwind(AssertUnwindSafe(|| runner::run_with(options, &running)));
            if ran.is_err() {
                running.failed("the helper panicked");
            }
        })
        .map_err(|e| format!("starting the helper's thread: {e}"))?;
    Ok(TetherHelper {
        control,
        thread: Some(thread),
    })
}

fn c_string(s: String) -> *mut c_char {
    // Messages and JSON hold no NUL; one that did would lose its tail, not the process.
    CString::new(s)
        .unwrap_or_else(|e| {
            let end = e.nul_position();
            CString::new(&e.into_vec()[..end]).expect("cut before the first NUL")
        })
        .into_raw()
}

/// Start a helper as `config_json` (a NUL-terminated JSON object) says, on a thread of its
/// own. Returns it, or NULL with `*error` set (when `error` is not NULL) to a message the
/// caller frees with `tether_string_free`.
///
/// # Safety
/// `config_json` is NULL or a NUL-terminated string; `error` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tether_helper_start(
    config_json: *const c_char,
    error: *mut *mut c_char,
) -> *mut TetherHelper {
    let started = catch_unwind(|| {
        if config_json.is_null() {
            return Err("the config is NULL".to_string());
        }
        // SAFETY: the caller passes a NUL-terminated string.
        let config = unsafe { CStr::from_ptr(config_json) };
        start(&config.to_string_lossy())
    })
    .unwrap_or_else(|_| Err("the helper panicked while starting".into()));
    match started {
        Ok(helper) => Box::into_raw(Box::new(helper)),
        Err(why) => {
            if !error.is_null() {
                // SAFETY: the caller passes a writable pointer.
                unsafe { *error = c_string(why) };
            }
            std::ptr::null_mut()
        }
    }
}

/// What the helper is doing, as a JSON object (engine_core::helper::runner::Status), to be freed with
/// `tether_string_free`; NULL for a NULL helper.
///
/// # Safety
/// `helper` is NULL or what `tether_helper_start` returned, not yet stopped.
#[no_mangle]
pub unsafe extern "C" fn tether_helper_status(helper: *const TetherHelper) -> *mut c_char {
    // SAFETY: the caller passes a live helper or NULL.
    let Some(helper) = (unsafe { helper.as_ref() }) else {
        return std::ptr::null_mut();
    };
    let status = serde_json::to_string(&helper.control.status())
        .unwrap_or_else(|e| format!("{{\"state\":\"failed\",\"error\":\"status: {e}\"}}"));
    c_string(status)
}

/// A new pairing code (the person at the phone asked for one, after wrong codes paused
/// pairing, say), to be freed with `tether_string_free`; NULL unless the helper listens with
/// pairing open. The old code stops working.
///
/// # Safety
/// `helper` is NULL or what `tether_helper_start` returned, not yet stopped.
#[no_mangle]
pub unsafe extern "C" fn tether_helper_new_code(helper: *const TetherHelper) -> *mut c_char {
    // SAFETY: the caller passes a live helper or NULL.
    let Some(helper) = (unsafe { helper.as_ref() }) else {
        return std::ptr::null_mut();
    };
    helper
        .control
        .new_code()
        .map_or(std::ptr::null_mut(), c_string)
}

/// Stop the helper (a host being served is let go), wait for its thread, and free it.
///
/// # Safety
/// `helper` is NULL or what `tether_helper_start` returned; it is not used again.
#[no_mangle]
pub unsafe extern "C" fn tether_helper_stop(helper: *mut TetherHelper) {
    if helper.is_null() {
        return;
    }
    // SAFETY: the caller passes what tether_helper_start returned, once.
    let mut helper = unsafe { Box::from_raw(helper) };
    helper.control.stop();
    if let Some(thread) = helper.thread.take() {
        let _ = thread.join();
    }
}

/// Free a string this library returned.
///
/// # Safety
/// `s` is NULL or a string from this library, freed once.
#[no_mangle]
pub unsafe extern "C" fn tether_string_free(s: *mut c_char) {
    if !s.is_null() {
        // SAFETY: the string came from CString::into_raw here.
        drop(unsafe { CString::from_raw(s) });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_config_becomes_the_flags() {
        let args = arguments(
            r#"{"model": "tiny", "mem_budget": "1G", "insecure": true,
                                 "once": false, "idle-timeout": 30, "pair": null}"#,
        )
        .unwrap();
        // Keys in sorted order (serde_json's map), which flags do not mind.
        assert_eq!(
            args,
            [
                "tether-helper",
                "--idle-timeout",
                "30",
                "--insecure",
                "--mem-budget",
                "1G",
                "--model",
                "tiny"
            ]
        );
        assert!(arguments("[1]").is_err());
        assert!(arguments(r#"{"model": ["tiny"]}"#).is_err());
        assert!(start(r#"{"no-such-flag": 1, "model": "tiny"}"#).is_err());
        assert!(
            start(r#"{"listen": "127.0.0.1:0"}"#).is_err(),
            "--model is required"
        );
    }
}
