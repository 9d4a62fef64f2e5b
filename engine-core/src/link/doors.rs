//! Opening a secure link from either end, whichever side opened the socket. The side that
//! waits (a helper that listens, a host that accepts helpers that dial in) lets peers in
//! through its key store and pairing code ([`Doors`]); the side that dials ([`dial`]) uses the
//! key it remembered for that address, or pairs by the code the other side shows and
//! remembers the key. The Noise roles follow the socket: who dials is the initiator.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use super::admission::{source_name, source_of};
use super::keys::{config_dir, short, KeyStore, Keypair, PairingCode, PublicKey};
use super::secure::{self, wire_limit, Accepted, Dial, Gate, Pairing, SecureLink};
use super::ws::{self, PageOrigin, WsLink};
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
    /// Sources that sent wrong codes lately, and until when each may not try again.
    strikes: Mutex<HashMap<IpAddr, Strikes>>,
}

/// A source's wrong pairing codes: the first is free (a typo), after the n-th it waits
/// [`FIRST_WAIT`] times 2^(n-2), up to [`LONGEST_WAIT`], before it may try again, so one
/// address cannot spend the code's budget of wrong tries ([`super::keys::MAX_WRONG`], then
/// pairing pauses for everyone) in a burst.
struct Strikes {
    wrong: u32,
    until: Instant,
}

const FIRST_WAIT: Duration = Duration::from_secs(1);
const LONGEST_WAIT: Duration = Duration::from_secs(300);

/// Sources remembered at most; past it the ones whose wait is over are forgotten.
const MAX_SOURCES: usize = 4096;

impl Doors {
    /// The doors of `role`'s key store (`helper` or `host`) in tether's config directory.
    /// Pairing is open while no peer is paired, or with `pair_new` always.
    pub fn open(role: &'static str, insecure: bool, pair_new: bool) -> Result<Doors, LinkError> {
        let dir = match insecure {
            true => None,
            false => Some(config_dir()?),
        };
        Doors::open_in(dir.as_deref(), role, pair_new)
    }

    /// [`Self::open`] with the key store in `dir` (`None`: plain links only).
    pub fn open_in(
        dir: Option<&std::path::Path>,
        role: &'static str,
        pair_new: bool,
    ) -> Result<Doors, LinkError> {
        let store = dir.map(|d| KeyStore::open(d, role)).transpose()?;
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
            strikes: Mutex::new(HashMap::new()),
        })
    }

    /// A new pairing code, asked for by the person at this device (after wrong codes paused
    /// pairing, say): the old one stops working and the count of wrong codes starts again.
    /// Each address keeps its wait, so one that paused pairing cannot pause it again at once.
    /// `None` if pairing is not open.
    pub fn new_code(&self) -> Option<String> {
        if !self.pairing.load(Ordering::SeqCst) {
            return None;
        }
        *self.code.lock().unwrap_or_else(PoisonError::into_inner) = PairingCode::new();
        self.pairing_code()
    }

    /// A new code each time Enter is pressed on the terminal this process runs in (the
    /// person at the device asks for one, after wrong codes paused pairing, say), shown with
    /// `show`. Nothing when standard input is not a terminal; the thread ends with the
    /// process.
    pub fn new_codes_on_enter(doors: &Arc<Doors>, show: impl Fn(&str) + Send + 'static) {
        use std::io::{BufRead, IsTerminal};
        if !std::io::stdin().is_terminal() {
            return;
        }
        let doors = doors.clone();
        let _ = std::thread::Builder::new()
            .name("new-pairing-code".into())
            .spawn(move || {
                for _ in std::io::stdin().lock().lines().map_while(Result::ok) {
                    if let Some(code) = doors.new_code() {
                        show(&code);
                    }
                }
            });
    }

    /// Whether wrong codes have paused pairing until [`Self::new_code`].
    pub fn pairing_paused(&self) -> bool {
        self.pairing.load(Ordering::SeqCst)
            && self
                .code
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .paused()
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

    /// How a peer from `source` (as [`source_of`] counts it), opened by `origin`, may pair now.
    fn pairing_for(&self, source: IpAddr, origin: &PageOrigin) -> Pairing<'_> {
        if !self.pairing.load(Ordering::SeqCst) {
            return Pairing::closed();
        }
        if let PageOrigin::Other(page) = origin {
            return Pairing::Closed(format!(
                "a web page from {page} may not pair with this device: pair from the page it \
                 serves itself, or from the command line"
            ));
        }
        let strikes = self.strikes.lock().unwrap_or_else(PoisonError::into_inner);
        match strikes
            .get(&source)
            .map(|s| s.until.saturating_duration_since(Instant::now()))
        {
            Some(wait) if !wait.is_zero() => Pairing::Closed(format!(
                "too many wrong pairing codes from {}: try again in {} s",
                source_name(source),
                wait.as_secs().max(1)
            )),
            _ => Pairing::Open(&self.code),
        }
    }

    /// Counts a wrong code from `source` (see [`Strikes`]).
    fn strike(&self, source: IpAddr) {
        let mut strikes = self.strikes.lock().unwrap_or_else(PoisonError::into_inner);
        if strikes.len() >= MAX_SOURCES {
            let now = Instant::now();
            strikes.retain(|_, s| s.until > now);
        }
        let s = strikes.entry(source).or_insert(Strikes {
            wrong: 0,
            until: Instant::now(),
        });
        s.wrong += 1;
        if s.wrong >= 2 {
            let wait = FIRST_WAIT.saturating_mul(1 << (s.wrong - 2).min(16));
            s.until = Instant::now() + wait.min(LONGEST_WAIT);
        }
    }

    /// The secure handshake with the peer at `peer`, opened by the web page `origin` if any
    /// (only a page this device served may pair); remembers a peer that pairs. When wrong
    /// codes pause pairing, `paused` is called (to tell the person at the device how to ask
    /// for a new code).
    pub fn let_in<L: Link>(
        &self,
        link: L,
        peer: SocketAddr,
        origin: &PageOrigin,
        paused: impl Fn(),
    ) -> Result<SecureLink<L>, LinkError> {
        let known = |k: &PublicKey| {
            self.store
                .as_ref()
                .is_some_and(|s| s.lock().unwrap_or_else(PoisonError::into_inner).knows(k))
        };
        let gate = Gate {
            insecure: self.store.is_none(),
            known: &known,
            pairing: self.pairing_for(source_of(peer.ip()), origin),
        };
        let result = secure::accept(link, &self.keys, &gate);
        if let Err(e) = &result {
            if secure::is_wrong_code(e) {
                self.strike(source_of(peer.ip()));
                if self.pairing_paused() {
                    paused();
                }
            }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::link::keys::MAX_WRONG;
    use crate::link::pair;

    fn doors(name: &str) -> Arc<Doors> {
        let dir = std::env::temp_dir().join(format!("tether-doors-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        Arc::new(Doors::open_in(Some(&dir), "helper", true).unwrap())
    }

    /// A host from `peer` pairing with `code` through `origin`: the helper's error, if any.
    fn pair_from(doors: &Doors, peer: &str, origin: &PageOrigin, code: &str) -> Option<String> {
        let (a, b) = pair();
        std::thread::scope(|s| {
            let host = s.spawn(|| secure::connect(a, &Keypair::generate(), Dial::Pair(code)));
            let peer: SocketAddr = peer.parse().unwrap();
            let helper = doors.let_in(b, peer, origin, || eprintln!("paused"));
            let _ = host.join().unwrap();
            helper.err().map(|e| e.to_string())
        })
    }

    #[test]
    fn pages_from_other_sites_cannot_pair_and_the_same_host_can() {
        let d = doors("origin");
        let code = d.pairing_code().unwrap();
        let other = PageOrigin::of("http://evil.example", Some("192.168.1.2:7341"));
        assert_eq!(other, PageOrigin::Other("http://evil.example".into()));
        let e = pair_from(&d, "10.0.0.1:1", &other, &code).unwrap();
        assert!(e.contains("may not pair"), "{e}");
        let same = PageOrigin::of("http://192.168.1.2:7341", Some("192.168.1.2:7341"));
        assert_eq!(same, PageOrigin::SameHost);
        assert_eq!(pair_from(&d, "10.0.0.1:2", &same, &code), None);
    }

    #[test]
    fn wrong_codes_slow_their_source_then_pause_pairing_until_a_new_code() {
        let d = doors("strikes");
        let code = d.pairing_code().unwrap();
        let wrong = if code == "000-000" {
            "000-001"
        } else {
            "000-000"
        };
        let page = PageOrigin::NotAPage;
        // A typo is free; the second wrong code makes that source wait, not others.
        for _ in 0..2 {
            let e = pair_from(&d, "10.0.0.1:1", &page, wrong).unwrap();
            assert!(e.starts_with("refused: wrong pairing code"), "{e}");
        }
        let e = pair_from(&d, "10.0.0.1:1", &page, &code).unwrap();
        assert!(e.contains("try again in 1 s"), "{e}");
        // Wrong codes from other sources, up to the code's budget: the shown code stays...
        for i in 2..MAX_WRONG {
            let e = pair_from(&d, &format!("10.0.1.{i}:1"), &page, wrong).unwrap();
            assert!(e.contains("wrong pairing code"), "{e}");
            assert_eq!(d.pairing_code().unwrap(), code);
        }
        // ...and then pairing pauses, for the right code too.
        assert!(d.pairing_paused());
        let e = pair_from(&d, "10.0.2.1:1", &page, &code).unwrap();
        assert!(e.contains("takes no more"), "{e}");
        // Until the person at the device asks for a new code. Each address keeps its count of
        // wrong codes (so the one made to wait cannot pause pairing again at once).
        let new = d.new_code().unwrap();
        assert!(!d.pairing_paused());
        // A fresh address in a /64 that was made to wait waits too: the prefix is the source.
        for _ in 0..2 {
            pair_from(&d, "[2001:db8:1:2::1]:1", &page, wrong).unwrap();
        }
        let e = pair_from(&d, "[2001:db8:1:2::9]:1", &page, &new).unwrap();
        assert!(e.contains("from 2001:db8:1:2::/64: try again"), "{e}");
        let strikes = d.strikes.lock().unwrap();
        assert_eq!(strikes[&"10.0.0.1".parse::<IpAddr>().unwrap()].wrong, 2);
        drop(strikes);
        assert_eq!(pair_from(&d, "10.0.3.1:1", &page, &new), None);
    }
}
