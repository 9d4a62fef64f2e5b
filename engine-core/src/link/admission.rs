//! Who may hold a connection before proving who they are. A stranger can open sockets faster
//! than a helper or a server can time them out; each one that is still in its handshake holds
//! a thread, buffers and a file descriptor. So the connections not yet let in are bounded, per
//! source address and in all, and when a new one arrives at a full bound the oldest idle one
//! of the source holding the most is closed to make room: a real peer that arrives in a flood
//! is always let in to try, and a flood from one address pushes out only its own sockets
//! first. A deadline (for the whole handshake, not per read) closes the slow ones.
//!
//! The table knows nothing of sockets: each entry carries the closure that closes its
//! connection (a socket shut down, a task told to stop), so the same bound serves the
//! helper's threads and the server's async connections.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::time::{Duration, Instant};

/// The bounds of an [`Admission`].
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Connections from one address at once.
    pub per_source: usize,
    /// Connections at once, from everywhere.
    pub total: usize,
    /// How long a connection may stay in the table (its whole handshake), if bounded; a busy
    /// one ([`Ticket::busy`]) is not timed.
    pub deadline: Option<Duration>,
}

/// The address the bounds count a peer under: an IPv4 address itself, an IPv6 address by its
/// /64 prefix (a network hands each host a whole /64, so one stranger holds 2^64 addresses:
/// counted one by one, each would get its own places here and its own pairing attempts), and
/// an IPv4-mapped IPv6 address (a dual-stack listener's IPv4 peer) as the IPv4 address.
pub fn source_of(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(v4) => IpAddr::V4(v4),
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6((u128::from(v6) & !((1u128 << 64) - 1)).into()),
        },
    }
}

/// A source as people read it: `2001:db8:1:2::/64` for an IPv6 prefix ([`source_of`]).
pub fn source_name(source: IpAddr) -> String {
    match source {
        IpAddr::V4(v4) => v4.to_string(),
        IpAddr::V6(v6) => format!("{v6}/64"),
    }
}

/// How often the deadline is checked: a connection past it is closed within this.
const REAP_EVERY: Duration = Duration::from_millis(250);

type Close = Box<dyn FnOnce() + Send>;

struct Entry {
    source: IpAddr,
    /// Since when it has been idle (admitted, or its last busy spell ended).
    since: Instant,
    /// Busy spells under way ([`Ticket::busy`]): such an entry is neither evicted nor timed.
    busy: usize,
    close: Close,
}

#[derive(Default)]
struct Table {
    entries: HashMap<u64, Entry>,
    next_id: u64,
    /// Connections closed to make room or at the deadline, for logs and tests.
    evicted: u64,
}

impl Table {
    fn from(&self, source: IpAddr) -> usize {
        self.entries.values().filter(|e| e.source == source).count()
    }

    /// The oldest idle entry of `source`, or of the source with the most entries.
    fn victim(&self, source: Option<IpAddr>) -> Option<u64> {
        let source = source.or_else(|| self.crowded())?;
        self.entries
            .iter()
            .filter(|(_, e)| e.source == source && e.busy == 0)
            .min_by_key(|(id, e)| (e.since, **id))
            .map(|(id, _)| *id)
    }

    /// The source with the most idle entries.
    fn crowded(&self) -> Option<IpAddr> {
        let mut counts: HashMap<IpAddr, usize> = HashMap::new();
        for e in self.entries.values().filter(|e| e.busy == 0) {
            *counts.entry(e.source).or_default() += 1;
        }
        counts.into_iter().max_by_key(|&(_, n)| n).map(|(s, _)| s)
    }

    /// Takes entry `id` out and returns its closer.
    fn evict(&mut self, id: u64) -> Option<Close> {
        let entry = self.entries.remove(&id)?;
        self.evicted += 1;
        Some(entry.close)
    }
}

/// The bounded table of connections not yet let in; see the module's doc. Cloning shares it.
#[derive(Clone)]
pub struct Admission {
    table: Arc<Mutex<Table>>,
    limits: Limits,
}

impl Admission {
    /// A new table; with a deadline, a thread closes connections past it (and ends with the
    /// last clone of the table).
    pub fn new(limits: Limits) -> Admission {
        let table = Arc::new(Mutex::new(Table::default()));
        if let Some(deadline) = limits.deadline {
            let weak = Arc::downgrade(&table);
            // Without the thread the deadline is not kept, but nothing else breaks.
            let _ = std::thread::Builder::new()
                .name("admission-deadline".into())
                .spawn(move || reap(&weak, deadline));
        }
        Admission { table, limits }
    }

    /// Lets a connection from `source` (counted by [`source_of`]) in, closing older idle ones
    /// to stay in bounds; `None` if every one in the way is busy (the caller closes the new
    /// one). `close` closes it, if it is pushed out or overstays; dropping the ticket (its
    /// handshake done, or failed) takes it out of the table.
    pub fn admit(&self, source: IpAddr, close: impl FnOnce() + Send + 'static) -> Option<Ticket> {
        let source = source_of(source);
        let mut closers = Vec::new();
        let id = {
            let mut t = lock(&self.table);
            let full = |t: &Table| {
                (
                    t.from(source) >= self.limits.per_source,
                    t.entries.len() >= self.limits.total,
                )
            };
            if full(&t).0 {
                closers.extend(t.victim(Some(source)).and_then(|v| t.evict(v)));
            }
            if full(&t).1 {
                closers.extend(t.victim(None).and_then(|v| t.evict(v)));
            }
            if full(&t) != (false, false) {
                return None;
            }
            let id = t.next_id;
            t.next_id += 1;
            t.entries.insert(
                id,
                Entry {
                    source,
                    since: Instant::now(),
                    busy: 0,
                    close: Box::new(close),
                },
            );
            id
        };
        // Outside the lock: a closer may take a while (a socket's shutdown) or admit again.
        for close in closers {
            close();
        }
        Some(Ticket {
            table: Arc::downgrade(&self.table),
            id,
        })
    }

    /// Connections in the table now.
    pub fn len(&self) -> usize {
        lock(&self.table).entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Connections closed so far to make room or at the deadline.
    pub fn evicted(&self) -> u64 {
        lock(&self.table).evicted
    }
}

/// Closes the entries past `deadline` every [`REAP_EVERY`] while the table lives.
fn reap(table: &Weak<Mutex<Table>>, deadline: Duration) {
    loop {
        std::thread::sleep(REAP_EVERY);
        let Some(table) = table.upgrade() else { return };
        let late: Vec<Close> = {
            let mut t = lock(&table);
            let ids: Vec<u64> = t
                .entries
                .iter()
                .filter(|(_, e)| e.busy == 0 && e.since.elapsed() >= deadline)
                .map(|(id, _)| *id)
                .collect();
            ids.into_iter().filter_map(|id| t.evict(id)).collect()
        };
        for close in late {
            close();
        }
    }
}

/// A connection's place in an [`Admission`]; dropping it gives the place back.
pub struct Ticket {
    table: Weak<Mutex<Table>>,
    id: u64,
}

impl Ticket {
    /// Marks the connection busy (serving a request) until the guard drops: it is then neither
    /// pushed out nor timed, and its idle time starts again after.
    pub fn busy(&self) -> Busy {
        self.with_entry(|e| e.busy += 1);
        Busy {
            table: self.table.clone(),
            id: self.id,
        }
    }

    fn with_entry(&self, f: impl FnOnce(&mut Entry)) {
        with_entry(&self.table, self.id, f);
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if let Some(table) = self.table.upgrade() {
            lock(&table).entries.remove(&self.id);
        }
    }
}

/// A busy spell of a connection; see [`Ticket::busy`].
pub struct Busy {
    table: Weak<Mutex<Table>>,
    id: u64,
}

impl Drop for Busy {
    fn drop(&mut self) {
        with_entry(&self.table, self.id, |e| {
            e.busy -= 1;
            e.since = Instant::now();
        });
    }
}

fn with_entry(table: &Weak<Mutex<Table>>, id: u64, f: impl FnOnce(&mut Entry)) {
    if let Some(table) = table.upgrade() {
        if let Some(e) = lock(&table).entries.get_mut(&id) {
            f(e);
        }
    }
}

fn lock(t: &Mutex<Table>) -> MutexGuard<'_, Table> {
    t.lock().unwrap_or_else(PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};

    fn ip(last: u8) -> IpAddr {
        IpAddr::from([10, 0, 0, last])
    }

    /// A ticket and the flag its closer sets.
    fn admitted(a: &Admission, source: IpAddr) -> (Ticket, Arc<AtomicBool>) {
        let closed = Arc::new(AtomicBool::new(false));
        let flag = closed.clone();
        let t = a.admit(source, move || flag.store(true, Ordering::SeqCst));
        (t.expect("room"), closed)
    }

    fn closed(flags: &[(Ticket, Arc<AtomicBool>)]) -> Vec<bool> {
        flags
            .iter()
            .map(|(_, c)| c.load(Ordering::SeqCst))
            .collect()
    }

    #[test]
    fn ipv6_peers_count_by_their_64_prefix_and_mapped_ipv4_as_ipv4() {
        let v6 = |s: &str| s.parse::<IpAddr>().unwrap();
        assert_eq!(
            source_of(v6("2001:db8:1:2:aaaa:bbbb:cccc:dddd")),
            v6("2001:db8:1:2::")
        );
        assert_ne!(source_of(v6("2001:db8:1:3::1")), v6("2001:db8:1:2::"));
        assert_eq!(source_of(v6("::ffff:10.0.0.7")), ip(7));
        assert_eq!(source_of(ip(7)), ip(7));
        assert_eq!(source_name(v6("2001:db8:1:2::")), "2001:db8:1:2::/64");
    }

    /// A stranger with a /64 (2^64 addresses) is one source: a flood from fresh addresses in
    /// it pushes out its own oldest connections, not another peer's.
    #[test]
    fn a_flood_from_one_ipv6_prefix_is_one_source() {
        let a = Admission::new(Limits {
            per_source: 3,
            total: 5,
            deadline: None,
        });
        let other = admitted(&a, "2001:db8:9::1".parse().unwrap());
        let flood: Vec<_> = (1..=6u16)
            .map(|i| admitted(&a, format!("2001:db8:1:2::{i:x}").parse().unwrap()))
            .collect();
        assert_eq!(closed(&flood), [true, true, true, false, false, false]);
        assert!(!other.1.load(Ordering::SeqCst));
        assert_eq!(a.len(), 4);
    }

    #[test]
    fn a_flood_from_one_source_pushes_out_its_own_oldest() {
        let a = Admission::new(Limits {
            per_source: 3,
            total: 5,
            deadline: None,
        });
        let other = admitted(&a, ip(2));
        let flood: Vec<_> = (0..6).map(|_| admitted(&a, ip(1))).collect();
        // Three places for the flood's source: its first three went, oldest first.
        assert_eq!(closed(&flood), [true, true, true, false, false, false]);
        assert!(
            !other.1.load(Ordering::SeqCst),
            "another source keeps its place"
        );
        assert_eq!(a.len(), 4);
        assert_eq!(a.evicted(), 3);

        // At the total bound, the source with the most gives way, not the one with one.
        let more: Vec<_> = (3..5).map(|i| admitted(&a, ip(i))).collect();
        assert!(!other.1.load(Ordering::SeqCst));
        assert_eq!(closed(&flood), [true, true, true, true, false, false]);
        assert_eq!(closed(&more), [false, false]);
        assert_eq!(a.len(), 5);

        // A ticket dropped gives its place back: no one is closed for the next.
        drop(more);
        let _next = admitted(&a, ip(9));
        assert_eq!(closed(&flood), [true, true, true, true, false, false]);
    }

    #[test]
    fn busy_connections_are_kept_and_the_deadline_closes_idle_ones() {
        let a = Admission::new(Limits {
            per_source: 2,
            total: 10,
            deadline: Some(Duration::from_millis(400)),
        });
        let first = admitted(&a, ip(1));
        let spell = first.0.busy();
        let second = admitted(&a, ip(1));
        // The busy one is older but stays; the idle one makes room.
        let third = admitted(&a, ip(1));
        assert!(!first.1.load(Ordering::SeqCst));
        assert!(second.1.load(Ordering::SeqCst));
        assert!(!third.1.load(Ordering::SeqCst));
        // With both places busy there is no room: the new one is turned away.
        let spell3 = third.0.busy();
        assert!(a.admit(ip(1), || {}).is_none());
        drop(spell3);

        std::thread::sleep(Duration::from_millis(1000));
        assert!(third.1.load(Ordering::SeqCst), "past the deadline");
        assert!(!first.1.load(Ordering::SeqCst), "busy: not timed");
        drop(spell);
        std::thread::sleep(Duration::from_millis(1000));
        assert!(first.1.load(Ordering::SeqCst), "idle again, then past it");
        assert!(a.is_empty());
    }
}
