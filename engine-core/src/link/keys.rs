//! Who a device is on a secure link, and whom it has paired with: a static X25519 key pair per
//! role (host, helper), the peers' public keys, and the short code a helper shows for pairing.
//! Natively, `KeyStore` keeps them in the platform's config directory (`$TETHER_CONFIG_DIR`,
//! else `~/.config/tether` on Linux, `~/Library/Application Support/tether` on macOS), private
//! files 0600. A browser has no such directory, so the store is native only; the key pair and
//! the pairing code build for wasm32, and where a tab keeps its keys is its own business.

#[cfg(not(target_arch = "wasm32"))]
use std::path::{Path, PathBuf};

#[cfg(not(target_arch = "wasm32"))]
use serde::{Deserialize, Serialize};

#[cfg(not(target_arch = "wasm32"))]
use super::LinkError;

/// A public key: 32 bytes of X25519.
pub type PublicKey = [u8; 32];

/// A device's static key pair for one role.
#[derive(Clone)]
pub struct Keypair {
    pub secret: [u8; 32],
    pub public: PublicKey,
}

impl Keypair {
    /// A fresh key pair from the system's randomness.
    pub fn generate() -> Keypair {
        let kp = snow::Builder::new(super::secure::KNOWN.parse().expect("valid Noise params"))
            .generate_keypair()
            .expect("the system has randomness");
        Keypair {
            secret: kp.private.try_into().expect("X25519 keys are 32 bytes"),
            public: kp.public.try_into().expect("X25519 keys are 32 bytes"),
        }
    }
}

/// A short hex name of a key, for messages ("key 3fa2c1d0").
pub fn short(key: &PublicKey) -> String {
    key[..4].iter().map(|b| format!("{b:02x}")).collect()
}

/// Keys as the key store writes them (lowercase hex); a browser tab keeps its keys the same
/// way in its page's storage.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A key written by [`hex`]; `None` if `s` is not 64 hex digits.
pub fn unhex(s: &str) -> Option<[u8; 32]> {
    let s = s.trim();
    if s.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

/// One paired peer.
#[cfg(not(target_arch = "wasm32"))]
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Peer {
    /// For a host, the helper's URL as given to `--helper`; for a helper, where the host
    /// connected from when it paired (a note for people).
    pub name: String,
    /// The peer's static public key, hex.
    pub key: String,
    /// When it paired, seconds since the Unix epoch.
    pub paired: u64,
}

/// A role's key pair and paired peers, on disk.
#[cfg(not(target_arch = "wasm32"))]
pub struct KeyStore {
    dir: PathBuf,
    role: &'static str,
    keypair: Keypair,
    peers: Vec<Peer>,
}

/// Where the key stores live: `$TETHER_CONFIG_DIR`, else the platform's config directory.
#[cfg(not(target_arch = "wasm32"))]
pub fn config_dir() -> Result<PathBuf, LinkError> {
    match std::env::var_os("TETHER_CONFIG_DIR") {
        Some(d) => Ok(PathBuf::from(d)),
        None => dirs::config_dir()
            .map(|d| d.join("tether"))
            .ok_or_else(|| LinkError::Io("no config directory on this platform".into())),
    }
}

#[cfg(not(target_arch = "wasm32"))]
fn io(what: &Path) -> impl FnOnce(std::io::Error) -> LinkError + '_ {
    move |e| LinkError::Io(format!("{}: {e}", what.display()))
}

/// Writes `bytes` to `path` readable by the owner only, through a temporary file renamed over
/// it, so a crash never leaves half a key.
#[cfg(not(target_arch = "wasm32"))]
fn write_private(path: &Path, bytes: &[u8]) -> Result<(), LinkError> {
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    let mut opts = std::fs::OpenOptions::new();
    opts.write(true).create(true).truncate(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut opts, 0o600);
    let mut f = opts.open(&tmp).map_err(io(&tmp))?;
    std::io::Write::write_all(&mut f, bytes).map_err(io(&tmp))?;
    std::fs::rename(&tmp, path).map_err(io(path))
}

#[cfg(not(target_arch = "wasm32"))]
impl KeyStore {
    /// The store of `role` ("host" or "helper") in `dir`: its key pair, made on first use, and
    /// its peers.
    pub fn open(dir: &Path, role: &'static str) -> Result<KeyStore, LinkError> {
        std::fs::create_dir_all(dir).map_err(io(dir))?;
        let key_path = dir.join(format!("{role}.key"));
        let keypair = match std::fs::read_to_string(&key_path) {
            Ok(text) => {
                let mut lines = text.lines().map(unhex);
                match (lines.next().flatten(), lines.next().flatten()) {
                    (Some(secret), Some(public)) => Keypair { secret, public },
                    _ => {
                        return Err(LinkError::Io(format!(
                            "{}: not a key pair (delete it to make a new one, then pair again)",
                            key_path.display()
                        )))
                    }
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let kp = Keypair::generate();
                let text = format!("{}\n{}\n", hex(&kp.secret), hex(&kp.public));
                write_private(&key_path, text.as_bytes())?;
                kp
            }
            Err(e) => return Err(io(&key_path)(e)),
        };
        let peers_path = dir.join(format!("{role}-peers.json"));
        let peers = match std::fs::read(&peers_path) {
            Ok(bytes) => serde_json::from_slice(&bytes)
                .map_err(|e| LinkError::Io(format!("{}: {e}", peers_path.display())))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(e) => return Err(io(&peers_path)(e)),
        };
        Ok(KeyStore {
            dir: dir.to_path_buf(),
            role,
            keypair,
            peers,
        })
    }

    pub fn keypair(&self) -> &Keypair {
        &self.keypair
    }

    /// The key of the peer paired under `name` (a host's helper URL), the latest if several.
    pub fn peer(&self, name: &str) -> Option<PublicKey> {
        self.peers
            .iter()
            .rev()
            .find(|p| p.name == name)
            .and_then(|p| unhex(&p.key))
    }

    /// Whether `key` belongs to a paired peer.
    pub fn knows(&self, key: &PublicKey) -> bool {
        self.peers
            .iter()
            .any(|p| unhex(&p.key).as_ref() == Some(key))
    }

    pub fn is_empty(&self) -> bool {
        self.peers.is_empty()
    }

    /// Remembers a newly paired peer (replacing an older entry of the same name) and saves.
    pub fn add(&mut self, name: &str, key: &PublicKey) -> Result<(), LinkError> {
        let paired = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        self.peers.retain(|p| p.name != name);
        self.peers.push(Peer {
            name: name.to_string(),
            key: hex(key),
            paired,
        });
        let path = self.dir.join(format!("{}-peers.json", self.role));
        let json = serde_json::to_vec_pretty(&self.peers).expect("peers serialise");
        write_private(&path, &json)
    }
}

/// The code a helper shows for pairing: six digits. A wrong try counts against it, and after
/// [`MAX_WRONG`] it takes no more until the person at the device asks for a new one
/// ([`PairingCode::new`]): a stranger gets that many guesses (one per attempt: SPAKE2 lets
/// nothing be guessed offline) at a one-in-a-million code, and wrong guesses never change the
/// code the person is reading off the screen.
pub struct PairingCode {
    digits: String,
    wrong: u32,
}

/// Wrong codes before pairing pauses.
pub const MAX_WRONG: u32 = 10;

impl PairingCode {
    pub fn new() -> PairingCode {
        let mut b = [0u8; 4];
        getrandom::fill(&mut b).expect("the system has randomness");
        PairingCode {
            digits: format!("{:06}", u32::from_le_bytes(b) % 1_000_000),
            wrong: 0,
        }
    }

    /// The code as people read it: "123-456".
    pub fn shown(&self) -> String {
        format!("{}-{}", &self.digits[..3], &self.digits[3..])
    }

    pub(super) fn digits(&self) -> &str {
        &self.digits
    }

    /// Counts a wrong try; returns true when that one paused pairing.
    pub fn wrong_try(&mut self) -> bool {
        self.wrong += 1;
        self.wrong == MAX_WRONG
    }

    /// Whether [`MAX_WRONG`] wrong codes have been tried: no more are taken.
    pub fn paused(&self) -> bool {
        self.wrong >= MAX_WRONG
    }
}

impl Default for PairingCode {
    fn default() -> Self {
        PairingCode::new()
    }
}

/// A code as a person may type it ("123-456", "123 456", "123456"): its digits.
pub fn normalise_code(code: &str) -> String {
    code.chars().filter(char::is_ascii_digit).collect()
}
