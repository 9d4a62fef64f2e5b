//! Opening a secure link from either end, whichever side opened the socket. The side that
//! waits (a helper that listens, a host that accepts helpers that dial in) lets peers in
//! through its key store and pairing code ([`Doors`]); the side that dials ([`dial`]) uses the
//! key it remembered for that address, or pairs by the code the other side shows and
//! remembers the key. The Noise roles follow the socket: who dials is the initiator.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, PoisonError};

use super::keys::{config_dir, short, KeyStore, Keypair, PairingCode, PublicKey};
use super::secure::{self, wire_limit, Accepted, Dial, Gate, SecureLink};
use super::ws::{self, WsLink};
use super::{Link, LinkError};

/// Who may come in on the waiting side: the key store of paired peers (none with
/// `--insecure`) and the pairing code new peers may pair with while pairing is open.
pub struct Doors {
    store: Option<Mutex<KeyStore>>,
    /// The store's key pair, or a throwaway one for plain links.
    keys: Keypair,
    code: Mutex<PairingCode>,
    /// Whether a new peer may pair now.
    pairing: AtomicBool,
    /// Keep pairing open after a peer pairs.
    pair_new: bool,
}

impl Doors {
    /// The doors of `role`'s key store (`helper` or `host`) in tether's config directory.
    /// Pairing is open while no peer is paired, or with `pair_new` always.
    pub fn open(role: &'static str, insecure: bool, pair_new: bool) -> Result<Doors, LinkError> {
        let store = match insecure {
            true => None,
            false => Some(KeyStore::open(&config_dir()?, role)?),
        };
        let keys = store
            .as_ref()
            .map_or_else(Keypair::generate, |s| s.keypair().clone());
        let pairing = store.as_ref().is_some_and(|s| s.is_empty() || pair_new);
        Ok(Doors {
            store: store.map(Mutex::new),
            keys,
            code: Mutex::new(PairingCode::new()),
            pairing: AtomicBool::new(pairing),
            pair_new,
        })
    }

    /// Plain links only (`--insecure`).
    pub fn is_insecure(&self) -> bool {
        self.store.is_none()
    }

    /// The code a new peer may pair with now, if pairing is open.
    pub fn pairing_code(&self) -> Option<String> {
        self.pairing.load(Ordering::SeqCst).then(|| self.code_now())
    }

    fn code_now(&self) -> String {
        self.code
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .shown()
    }

    /// The key this side shares with `peer` for lending it weights
    /// ([`crate::lending::lending_key`]), if `peer` is paired (never with `--insecure`).
    pub fn lending_key(&self, peer: &PublicKey) -> Option<[u8; 32]> {
        let store = self.store.as_ref()?;
        if !store
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .knows(peer)
        {
            return None;
        }
        crate::lending::lending_key(&self.keys, peer).ok()
    }

    /// The secure handshake with the peer at `peer` (an address, for the key store and the
    /// log); remembers a peer that pairs. Wrong codes may draw a new code: `show` is called
    /// with it.
    pub fn let_in<L: Link>(
        &self,
        link: L,
        peer: &str,
        show: impl Fn(&str),
    ) -> Result<SecureLink<L>, LinkError> {
        let known = |k: &PublicKey| {
            self.store
                .as_ref()
                .is_some_and(|s| s.lock().unwrap_or_else(PoisonError::into_inner).knows(k))
        };
        let gate = Gate {
            insecure: self.store.is_none(),
            known: &known,
            pairing: self.pairing.load(Ordering::SeqCst).then_some(&self.code),
        };
        let shown = self.code_now();
        let result = secure::accept(link, &self.keys, &gate);
        if result.is_err() && self.code_now() != shown {
            show(&self.code_now());
        }
        let (link, who) = result?;
        if let (Accepted::Paired(key), Some(store)) = (who, &self.store) {
            let mut store = store.lock().unwrap_or_else(PoisonError::into_inner);
            // Named with the key: peers that share an address (every helper on a server's
            // /helper) must not replace each other.
            store.add(&format!("{peer} ({})", short(&key)), &key)?;
            eprintln!("paired with {peer} (key {})", short(&key));
            if !self.pair_new {
                self.pairing.store(false, Ordering::SeqCst);
            }
        }
        Ok(link)
    }
}

/// How the dialing side opens a link.
pub struct DialOptions<'a> {
    /// Whose key store: `host` (a host dialing helpers) or `helper` (a helper joining a host).
    pub role: &'static str,
    /// What the other side is, for messages: "helper" or "host".
    pub peer: &'static str,
    /// A plain link (`--insecure`), for a peer started with `--insecure` too.
    pub insecure: bool,
    /// The pairing code the other side shows: pairs if no key is remembered for `url` (or the
    /// peer no longer answers to it).
    pub pair: Option<&'a str>,
    /// Largest frame, before encryption.
    pub max_frame: usize,
}

/// The paired, encrypted link to `url` (plain with `insecure`): by the key remembered for
/// `url`, else by the pairing code, whose key is then remembered.
pub fn dial(url: &str, o: &DialOptions) -> Result<SecureLink<WsLink>, LinkError> {
    // A helper's replies are what the host asks for: bounded (see ws's module doc).
    let open = || {
        let link = ws::connect(url, wire_limit(o.max_frame))?;
        Ok::<_, LinkError>(if o.role == "helper" {
            link.as_helper()
        } else {
            link
        })
    };
    if o.insecure {
        let (link, _) = secure::connect(open()?, &Keypair::generate(), Dial::Insecure)?;
        return Ok(link);
    }
    let mut store = KeyStore::open(&config_dir()?, o.role)?;
    if let Some(key) = store.peer(url) {
        match secure::connect(open()?, store.keypair(), Dial::Known(key)) {
            Ok((link, _)) => return Ok(link),
            Err(LinkError::Refused(why)) if o.pair.is_some() => {
                eprintln!(
                    "the {} refused the remembered key ({why}); pairing again",
                    o.peer
                );
            }
            Err(e) => return Err(e),
        }
    }
    let Some(code) = o.pair else {
        return Err(LinkError::Refused(format!(
            "not paired with the {} at {url} yet: pass the pairing code it shows with --pair \
             CODE (once)",
            o.peer
        )));
    };
    pair_with(url, open()?, &mut store, code, o.peer)
}

/// Pair over `ws` (the peer at `url`) by `code`; remember the peer's key in `store`.
pub fn pair_with(
    url: &str,
    ws: WsLink,
    store: &mut KeyStore,
    code: &str,
    peer: &str,
) -> Result<SecureLink<WsLink>, LinkError> {
    let (link, key) = secure::connect(ws, store.keypair(), Dial::Pair(code))?;
    let key = key.ok_or_else(|| LinkError::Io(format!("the {peer} gave no key")))?;
    store.add(url, &key)?;
    eprintln!(
        "paired with the {peer} at {url} (key {}); later connections need no --pair",
        short(&key)
    );
    Ok(link)
}
