/* tether's helper as a library: the C ABI of phone-ios (src/ffi.rs), which an iOS app links as
 * a static library. phone-ios/tests/c_abi.rs compiles a C program against this header and
 * drives a helper through it, so a change on either side that breaks the other fails there.
 *
 * A helper runs on a thread of its own from the moment it starts until it is stopped: it
 * listens for hosts (`"listen": "0.0.0.0:7341"`) or joins one (`"join": "ws://HOST:PORT"`,
 * `"pair": "215-770"` the first time), as `tether-helper` does with the same flags. */
#ifndef TETHER_HELPER_H
#define TETHER_HELPER_H

#ifdef __cplusplus
extern "C" {
#endif

/* A running helper. */
typedef struct TetherHelper TetherHelper;

/* Start a helper. `config_json` is a JSON object whose keys are tether-helper's flags
 * (`{"model": "qwen35-0.8b", "join": "ws://192.168.1.5:8080/helper", "pair": "215-770"}`; a
 * string or number is the flag's value, true gives the flag alone). On iOS, without
 * "mem-budget" it offers half of what os_proc_available_memory() allows; "backend": "metal"
 * computes on Metal itself (not the default: never run yet). Returns NULL on a bad
 * config, with *error (if error is not NULL) set to a message to free with
 * tether_string_free. A model that cannot be loaded is reported by tether_helper_status. */
TetherHelper *tether_helper_start(const char *config_json, char **error);

/* What the helper is doing, as a JSON object: {"state": "starting" | "listening" | "joining" |
 * "serving" | "stopped" | "failed", "address", "pairing_code", "pairing_paused", "host", "sessions",
 * "mem_budget", "helper": {"kv_pages", "kv_bytes", "held_bytes", ...}, "link_sent_bytes",
 * "link_received_bytes", "error"}. Free it with tether_string_free. */
char *tether_helper_status(const TetherHelper *helper);

/* A new pairing code, when the person at the phone asks for one (after wrong codes paused
 * pairing: "pairing_paused" in the status); the old code stops working. NULL unless the helper
 * listens with pairing open. Free it with tether_string_free. */
char *tether_helper_new_code(const TetherHelper *helper);

/* Stop the helper (a host being served is let go within a fraction of a second), wait for
 * its thread and free it. The pointer is not valid afterwards. */
void tether_helper_stop(TetherHelper *helper);

/* Free a string this library returned. */
void tether_string_free(char *s);

#ifdef __cplusplus
}
#endif

#endif /* TETHER_HELPER_H */
