//! What the secure link costs: frames of a prefill ubatch's size (the 0.8B's 256 x 1024
//! residual rows, 1 MiB) and of a decode step's query (8 KiB) sent one way over a loopback
//! WebSocket and received, plain (`--insecure`) against paired and encrypted (Noise,
//! ChaCha20-Poly1305). Bytes per second of frame payload.

use std::thread;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use engine_core::link::keys::{Keypair, PairingCode, PublicKey};
use engine_core::link::secure::{self, wire_limit, Dial, Gate, Pairing};
use engine_core::link::ws::{self, WsListener};
use engine_core::link::Link;

/// A connected (host, helper) pair over loopback, encrypted or plain.
fn connected(encrypted: bool) -> (Box<dyn Link>, Box<dyn Link>) {
    let listener = WsListener::bind("127.0.0.1:0", wire_limit(64 << 20)).unwrap();
    let url = format!("ws://{}", listener.local_addr());
    let code = std::sync::Mutex::new(PairingCode::new());
    let shown = code.lock().unwrap().shown();
    let (host_keys, helper_keys) = (Keypair::generate(), Keypair::generate());
    thread::scope(|s| {
        let helper = s.spawn(|| {
            let nobody = |_: &PublicKey| false;
            let gate = Gate {
                insecure: !encrypted,
                known: &nobody,
                pairing: Pairing::Open(&code),
            };
            let ws = listener.accept().unwrap();
            Box::new(secure::accept(ws, &helper_keys, &gate).unwrap().0) as Box<dyn Link>
        });
        let ws = ws::connect(&url, wire_limit(64 << 20)).unwrap();
        let how = if encrypted {
            Dial::Pair(&shown)
        } else {
            Dial::Insecure
        };
        let host = Box::new(secure::connect(ws, &host_keys, how).unwrap().0) as Box<dyn Link>;
        (host, helper.join().unwrap())
    })
}

fn link(c: &mut Criterion) {
    let mut g = c.benchmark_group("link");
    g.sample_size(10);
    for size in [8 << 10, 1 << 20] {
        g.throughput(Throughput::Bytes(size as u64 * 16));
        for encrypted in [false, true] {
            let (mut host, mut helper) = connected(encrypted);
            let name = if encrypted { "encrypted" } else { "plain" };
            g.bench_with_input(BenchmarkId::new(name, size), &size, |b, &size| {
                b.iter(|| {
                    // 16 frames in flight, as a pipelined prefill keeps the link busy.
                    for _ in 0..16 {
                        host.send(vec![7u8; size]).unwrap();
                    }
                    for _ in 0..16 {
                        assert_eq!(helper.recv().unwrap().len(), size);
                    }
                })
            });
        }
    }
    g.finish();
}

criterion_group!(benches, link);
criterion_main!(benches);
