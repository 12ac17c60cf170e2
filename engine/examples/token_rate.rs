//! Where a token stream's time goes, on a packed token dataset: the document stream alone, with
//! each record decoded, and the whole token stream (windows cut and converted).
//!
//!     cargo run --release -p ramjet-engine --example token_rate -- DATASET [SEQ_LEN] [ROUNDS]

use std::time::Instant;

use ramjet_engine::tokens::{TokenConfig, TokenDtype, TokenOptions, TokenStream};
use ramjet_engine::{Stream, StreamConfig};

fn main() -> ramjet_engine::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let url = args
        .get(1)
        .expect("usage: token_rate DATASET [SEQ_LEN] [ROUNDS]")
        .clone();
    let seq_len: usize = args.get(2).map_or(2048, |s| s.parse().expect("SEQ_LEN"));
    let rounds: usize = args.get(3).map_or(3, |s| s.parse().expect("ROUNDS"));
    let ranged = std::env::var("RANGED").map_or(true, |v| v != "0");
    let cfg = |url: &str| {
        let mut c = StreamConfig::new(url);
        if !ranged {
            c.first_ranged_samples_max = 0;
            c.ranged_until_shard_bytes_max = 0;
        }
        c
    };
    for r in 0..rounds {
        let t = Instant::now();
        let mut docs = 0u64;
        for s in Stream::open(cfg(&url))? {
            s?;
            docs += 1;
        }
        let stream = t.elapsed();
        let t = Instant::now();
        for s in Stream::open(cfg(&url))? {
            let s = s?;
            std::hint::black_box(s.values()?);
        }
        let decoded = t.elapsed();
        let t = Instant::now();
        let mut ts = TokenStream::open(TokenConfig {
            stream: cfg(&url),
            tokens: TokenOptions {
                seq_len,
                eos: Some(0),
                dtype: TokenDtype::Int32,
                ..Default::default()
            },
            epoch: 0,
            resume: None,
        })?;
        let mut windows = 0;
        while let Some(b) = ts.next_batch()? {
            windows += b.windows.len();
        }
        let tokens = t.elapsed();
        println!(
            "round {r}: {docs} documents: stream {stream:.2?}, with decode {decoded:.2?}; token stream {tokens:.2?} ({windows} windows, {:.0}/s)",
            windows as f64 / tokens.as_secs_f64()
        );
    }
    Ok(())
}
