use std::net::{TcpListener, TcpStream};
use std::time::Duration;

use super::*;

/// `world` ranks' links over real loopback sockets: rank r sends to r+1, receives from r-1.
fn ring(world: usize) -> Vec<RingLinks> {
    let listeners: Vec<TcpListener> = (0..world)
        .map(|_| TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    let sends: Vec<TcpStream> = (0..world)
        .map(|r| TcpStream::connect(listeners[(r + 1) % world].local_addr().unwrap()).unwrap())
        .collect();
    let recvs: Vec<TcpStream> = listeners.iter().map(|l| l.accept().unwrap().0).collect();
    sends
        .into_iter()
        .zip(recvs)
        .enumerate()
        .map(|(rank, (send, recv))| {
            let timeout = Duration::from_secs(60);
            RingLinks::new(rank, world, send, recv, timeout, Duration::from_micros(50)).unwrap()
        })
        .collect()
}

/// Deterministic values with very different magnitudes, so summation order shows in the bits.
fn values(rank: usize, n: usize) -> Vec<f32> {
    let mut x = 0x9E37_79B9u32.wrapping_mul(rank as u32 + 1);
    (0..n)
        .map(|i| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            let scale = [1e-3f32, 1.0, 1e4][(i + rank) % 3];
            (x as f32 / u32::MAX as f32 - 0.5) * scale
        })
        .collect()
}

/// The documented order: segment c is ((x_c + x_{c+1}) + ...) + x_{c-1}.
fn expected_sum(inputs: &[Vec<f32>]) -> Vec<f32> {
    let (w, n) = (inputs.len(), inputs[0].len());
    let mut out = vec![0f32; n];
    for c in 0..w {
        for i in segment(n, w, c) {
            let mut acc = inputs[c][i];
            for k in 1..w {
                acc += inputs[(c + k) % w][i];
            }
            out[i] = acc;
        }
    }
    out
}

fn run_all<T: Send>(world: usize, f: impl Fn(&mut RingLinks) -> T + Sync) -> Vec<T> {
    let mut links = ring(world);
    std::thread::scope(|s| {
        let handles: Vec<_> = links.iter_mut().map(|l| s.spawn(|| f(l))).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn check_sum(world: usize, n: usize) {
    let inputs: Vec<Vec<f32>> = (0..world).map(|r| values(r, n)).collect();
    let want = expected_sum(&inputs);
    let got = run_all(world, |l| {
        let mut buf = inputs[l.rank].clone();
        l.all_reduce_sum(&mut buf)
            .map_err(|e| format!("{e:?}"))
            .unwrap();
        buf
    });
    for (rank, buf) in got.iter().enumerate() {
        let same = buf
            .iter()
            .zip(&want)
            .all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(
            same,
            "world {world}, n {n}: rank {rank} differs from the ordered sum"
        );
    }
}

#[test]
fn all_reduce_equals_the_ordered_sum_bit_for_bit_on_every_rank() {
    for world in 1..=4 {
        for n in [0, 1, 2, 3, 5, 7, 1000, 65_537, 200_003] {
            check_sum(world, n);
        }
    }
}

#[test]
fn all_reduce_streams_ten_million_floats() {
    check_sum(3, 10_000_001);
}

#[test]
fn the_order_is_not_trivially_exact() {
    // Guards the test above: with these values a different order gives different bits.
    let inputs: Vec<Vec<f32>> = (0..3).map(|r| values(r, 3000)).collect();
    let ordered = expected_sum(&inputs);
    let reversed: Vec<f32> = (0..3000)
        .map(|i| (inputs[2][i] + inputs[1][i]) + inputs[0][i])
        .collect();
    assert!(ordered.iter().zip(&reversed).any(|(a, b)| a != b));
}

#[test]
fn mean_and_f64_sums_agree_on_every_rank() {
    let got = run_all(3, |l| {
        let mut m = vec![l.rank as f32 * 3.0; 10];
        l.all_reduce_mean(&mut m).unwrap();
        let mut s = vec![l.rank as f64 + 0.5, 1.0];
        l.all_reduce_sum(&mut s).unwrap();
        (m, s)
    });
    for (m, s) in got {
        assert_eq!(m, vec![3.0; 10]);
        assert_eq!(s, vec![4.5, 3.0]);
    }
}

#[test]
fn broadcast_from_any_root_reaches_every_rank() {
    for world in 1..=4 {
        for root in 0..world {
            let n = 150_001;
            let got = run_all(world, |l| {
                let mut buf = values(l.rank, n);
                l.broadcast(&mut buf, root).unwrap();
                buf
            });
            let want = values(root, n);
            assert!(got.iter().all(|b| *b == want), "world {world} root {root}");
        }
    }
}

#[test]
fn segments_cover_the_buffer_in_order() {
    for (n, w) in [(0, 3), (1, 4), (10, 3), (7, 7), (5, 2)] {
        let mut next = 0;
        for i in 0..w {
            let s = segment(n, w, i);
            assert_eq!(s.start, next);
            next = s.end;
        }
        assert_eq!(next, n);
    }
}

/// A sharded optimizer's halves: reduce-scatter leaves the mean in the owned segment, bit for
/// bit what the all-reduce gives there; the all-gather of owned segments then rebuilds the
/// whole buffer; together they send exactly the all-reduce's bytes.
#[test]
fn reduce_scatter_then_all_gather_is_the_all_reduce_in_bits_and_bytes() {
    for world in 1..=4 {
        for n in [0, 1, 5, 1000, 65_537] {
            let inputs: Vec<Vec<f32>> = (0..world).map(|r| values(r, n)).collect();
            let split = run_all(world, |l| {
                let mut buf = inputs[l.rank].clone();
                l.reduce_scatter_mean(&mut buf).unwrap();
                let owned = buf[l.owned(n)].to_vec();
                // What is not owned is overwritten by its owner's values.
                let keep = l.owned(n);
                buf.iter_mut()
                    .enumerate()
                    .filter(|(i, _)| !keep.contains(i))
                    .for_each(|(_, x)| *x = f32::NAN);
                l.all_gather(&mut buf).unwrap();
                (owned, buf, l.bytes_sent())
            });
            let whole = run_all(world, |l| {
                let mut buf = inputs[l.rank].clone();
                l.all_reduce_mean(&mut buf).unwrap();
                (buf, l.bytes_sent())
            });
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            for (rank, ((owned, gathered, sent), (reduced, sent_whole))) in
                split.iter().zip(&whole).enumerate()
            {
                let seg = segment(n, world, (rank + 1) % world);
                assert_eq!(bits(owned), bits(&reduced[seg]), "world {world} n {n}");
                assert_eq!(
                    bits(gathered),
                    bits(reduced),
                    "world {world} n {n} rank {rank}"
                );
                assert_eq!(sent, sent_whole, "world {world} n {n} rank {rank}");
            }
            if world > 1 && n >= world {
                let expected = (2 * (world - 1) * (n / world) * 4) as u64;
                assert!(whole[0].1 >= expected, "{} < {expected}", whole[0].1);
            }
        }
    }
}
