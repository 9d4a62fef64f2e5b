//! The multi-token-prediction head (issue 36, item 1): read from a checkpoint (`mtp.*`) and
//! from a GGUF (`blk.N.nextn.*`), and its forward against `scripts/mtp-reference.py`, an
//! independent numpy version of the model and the head computed in f64
//! (`tests/fixtures/mtp_tiny`: `tether synth --preset tiny --mtp --dtype f32 --weight-seed 7`,
//! then the script on 20 tokens with a chain of 4).

use std::path::PathBuf;

use engine_core::backend::PageRows;
use engine_core::cache_types::CacheTypes;
use engine_core::draft::{DraftKind, Drafts, MtpDrafts};
use engine_core::generate::{argmax, Generation, Sampler, SamplingParams};
use engine_core::gguf::quantize;
use engine_core::host::split::SplitPlan;
use engine_core::host::Sequence;
use engine_core::kv::PagedKv;
use engine_core::source::{load_model, LoadOptions};
use engine_core::{Backend, CpuBackend, Logits, Model};
use tests::{max_abs_diff, Reference};

/// The fixtures' bound on fp32 logits.
const TOLERANCE: f32 = 1e-4;

fn fixture_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures/mtp_tiny")
}

fn reference() -> Reference {
    let bytes = std::fs::read(fixture_dir().join("reference.safetensors")).unwrap();
    Reference::from_bytes(&bytes)
}

/// The rows of `[n, width]` values `a .. b`.
fn rows(v: &[f32], width: usize, a: usize, b: usize) -> &[f32] {
    &v[a * width..b * width]
}

/// The main model's logits and final rows, the head over every (hidden row, next token) pair,
/// then a chain of drafts, each within the fixtures' bound of the reference; returns the
/// head's logits over the pairs and the chain's.
fn check_against_reference(model: &Model, what: &str) -> (Vec<f32>, Vec<f32>) {
    let r = reference();
    let be = &CpuBackend;
    let c = &model.config;
    let (h, v) = (c.hidden_size, c.vocab_size);
    let tokens = r.ids("tokens");
    let t = tokens.len();
    let mut state = model.new_state(16);
    let (hidden, logits) = model.forward_hidden(be, &mut state, &tokens).unwrap();
    let d = max_abs_diff(&logits, &r.f32("logits").1);
    assert!(d <= TOLERANCE, "{what}: main logits differ by {d}");
    let d = max_abs_diff(&hidden, &r.f32("hidden").1);
    assert!(d <= TOLERANCE, "{what}: final rows differ by {d}");

    // Every pair (h_i, x_{i+1}) at position i, in one pass through the head's cache.
    let mut kv = model.new_mtp_cache(16, CacheTypes::F32);
    let pairs = (rows(&hidden, h, 0, t - 1), &tokens[1..]);
    let (_, mtp_logits) = model.mtp(be, &mut kv, pairs, 0).unwrap();
    let d = max_abs_diff(&mtp_logits, &r.f32("mtp_logits").1);
    assert!(d <= TOLERANCE, "{what}: the head's logits differ by {d}");

    // The chain: the last row with the token drawn from it, then each draft with the head's
    // own output as the hidden row.
    let next = argmax(rows(&logits, v, t - 1, t));
    assert_eq!(vec![next], r.ids("next"), "{what}");
    let (mut g, mut token) = (rows(&hidden, h, t - 1, t).to_vec(), next);
    let (mut drafts, mut chain) = (Vec::new(), Vec::new());
    for j in 0..r.ids("chain_tokens").len() {
        let (out, l) = model.mtp(be, &mut kv, (&g, &[token]), t - 1 + j).unwrap();
        token = argmax(&l);
        drafts.push(token);
        chain.extend_from_slice(&l);
        g = out;
    }
    assert_eq!(drafts, r.ids("chain_tokens"), "{what}: chained drafts");
    let d = max_abs_diff(&chain, &r.f32("chain_logits").1);
    assert!(d <= TOLERANCE, "{what}: the chain's logits differ by {d}");
    (mtp_logits, chain)
}

#[test]
fn the_head_matches_the_numpy_reference() {
    let model = Model::load_dir(&fixture_dir()).unwrap();
    assert!(model.has_mtp());
    check_against_reference(&model, "safetensors");
}

/// `tether quantize` writes the head as llama.cpp's converter does (block `layers`,
/// `nextn.*`, its norms as `1 + w`, `nextn_predict_layers`), and the GGUF reader takes it
/// back: an f32 GGUF computes the same head.
#[test]
fn a_gguf_holds_the_head() {
    let (config, tensors) = load_model_tensors();
    let mut bytes = Vec::new();
    let no_tokenizer = |_: &mut engine_core::gguf::Writer| Ok(());
    let f32_file = quantize::FileType::parse("f32").unwrap();
    quantize::write(
        &config,
        &tensors,
        "mtp_tiny",
        f32_file,
        no_tokenizer,
        &mut bytes,
        &mut |_, _| {},
    )
    .unwrap();
    let g = engine_core::gguf::Gguf::parse(&bytes).unwrap();
    let names: Vec<&str> = g.tensors.iter().map(|t| t.name.as_str()).collect();
    for name in [
        "blk.8.nextn.eh_proj.weight",
        "blk.8.nextn.enorm.weight",
        "blk.8.attn_q.weight",
    ] {
        assert!(names.contains(&name), "{name} missing from {names:?}");
    }
    assert_eq!(g.get("qwen35.block_count").unwrap().as_u64(), Some(9));
    assert_eq!(
        g.get("qwen35.nextn_predict_layers").unwrap().as_u64(),
        Some(1)
    );

    let path = std::env::temp_dir().join(format!("tether-mtp-{}.gguf", std::process::id()));
    std::fs::write(&path, &bytes).unwrap();
    let loaded = engine_core::gguf::qwen35::load(&path);
    std::fs::remove_file(&path).unwrap();
    let (config, tensors) = loaded.unwrap();
    assert_eq!(config.mtp_layers, 1);
    let model = Model::from_tensors(config, &tensors).unwrap();
    check_against_reference(&model, "f32 GGUF");
}

/// The fixture's config and tensors as a checkpoint directory gives them.
fn load_model_tensors() -> (engine_core::ModelConfig, engine_core::weights::TensorMap) {
    let dir = fixture_dir();
    let config = Model::read_config(&dir).unwrap();
    (config, engine_core::weights::load_dir(&dir).unwrap())
}

/// `--mtp` gives a preset the head; without it (or with its tensors gone from a checkpoint
/// whose config still declares one) there is none, and asking it for a draft says so. The
/// head's weights count in the model's bytes (what `tether plan` and serve's memory divide).
#[test]
fn a_model_without_the_head_says_so() {
    let with = LoadOptions {
        mtp: true,
        ..Default::default()
    };
    assert!(load_model("tiny", &with).unwrap().has_mtp());
    let model = load_model("tiny", &LoadOptions::default()).unwrap();
    assert!(!model.has_mtp());
    let (config, mut tensors) = load_model_tensors();
    let full = Model::from_tensors(config.clone(), &tensors).unwrap();
    // The head's matrices (its 2-D f32 tensors) are weights the plan must count.
    let head_bytes: usize = tensors
        .iter()
        .filter(|(name, t)| name.starts_with("mtp.") && t.shape.len() == 2)
        .map(|(_, t)| t.shape.iter().product::<usize>() * 4)
        .sum();
    tensors.retain(|name, _| !name.starts_with("mtp."));
    let stripped = Model::from_tensors(config, &tensors).unwrap();
    assert!(!stripped.has_mtp());
    assert!(head_bytes > 0);
    assert_eq!(full.weight_bytes(), stripped.weight_bytes() + head_bytes);
    let mut kv = stripped.new_mtp_cache(16, CacheTypes::F32);
    let err = stripped
        .mtp(&CpuBackend, &mut kv, (&[0.0; 64], &[1]), 0)
        .unwrap_err();
    assert!(
        err.to_string().contains("no multi-token-prediction head"),
        "{err}"
    );
}

/// Every key and value row of an f32 cache, in order.
fn cache_rows(kv: &PagedKv) -> Vec<f32> {
    let width = kv.row_width();
    let mut out = Vec::new();
    for page in kv.pages() {
        for rows in [&page.k, &page.v] {
            let PageRows::Values(a) = rows else {
                panic!("an f32 cache holds f32 rows")
            };
            out.extend_from_slice(&CpuBackend.download(a)[..page.len * width]);
        }
    }
    out
}

/// The head's cache over `context` and the drafts it makes after it and the token `tok`
/// drawn after it, computed from scratch: the main model over `context`, the head over every
/// pair, then `k` chained.
fn drafts_from_scratch(model: &Model, context: &[u32], tok: u32, k: usize) -> (Vec<f32>, Vec<u32>) {
    let be = &CpuBackend;
    let (h, t) = (model.config.hidden_size, context.len());
    let mut state = model.new_state(PAGE);
    let (hidden, _) = model.forward_hidden(be, &mut state, context).unwrap();
    let mut kv = model.new_mtp_cache(PAGE, CacheTypes::F32);
    if t > 1 {
        let pairs = (rows(&hidden, h, 0, t - 1), &context[1..]);
        model.mtp(be, &mut kv, pairs, 0).unwrap();
    }
    let cache = cache_rows(&kv);
    let (mut g, mut token) = (rows(&hidden, h, t - 1, t).to_vec(), tok);
    let mut drafts = Vec::new();
    for j in 0..k {
        let (out, l) = model.mtp(be, &mut kv, (&g, &[token]), t - 1 + j).unwrap();
        token = argmax(&l);
        drafts.push(token);
        g = out;
    }
    (cache, drafts)
}

const PAGE: usize = 16;

/// The head's cache as a generation keeps it: filled from the prompt's rows, extended by a
/// draft, then cut back to the kept tokens and refilled from the main model's rows of them.
/// After every number of kept drafts (0 to all), the next draft is the one made from scratch
/// over the same tokens.
#[test]
fn the_heads_cache_follows_the_kept_tokens() {
    let model = Model::load_dir(&fixture_dir()).unwrap();
    let be = &CpuBackend;
    let vocab = model.config.vocab_size;
    let prompt = reference().ids("tokens");
    let p = prompt.len();
    const K: usize = 4;
    for kept in 0..=K {
        let mut seq = Sequence::typed(&model.config, PAGE, CacheTypes::F32, be).unwrap();
        let mut drafts = MtpDrafts::new(&model, &seq.state, K).unwrap();
        let (hidden, logits) = seq.forward_rows(&model, be, &prompt).unwrap();
        drafts.take_rows(&model, be, &hidden, 0, &prompt).unwrap();
        let tok = argmax(&logits[(p - 1) * vocab..]);
        let (cache, want) = drafts_from_scratch(&model, &prompt, tok, K);
        assert_eq!(cache_rows(drafts.cache()), cache);
        let draft = drafts.propose(&model, be, tok, p, K).unwrap();
        assert_eq!(draft, want);

        // The model checks [tok, draft..]; `kept` of the drafts stay.
        let rows_in: Vec<u32> = std::iter::once(tok).chain(draft.iter().copied()).collect();
        let before = seq.state.checkpoint(be);
        let (hidden, logits) = seq.forward_rows(&model, be, &rows_in).unwrap();
        seq.rewind(be, &before).unwrap();
        seq.forward(&model, be, &rows_in[..=kept], Logits::None, None)
            .unwrap();
        drafts
            .accept(&model, be, &hidden, &draft[..kept], p)
            .unwrap();

        let context: Vec<u32> = prompt.iter().chain(&rows_in[..=kept]).copied().collect();
        let next = argmax(&logits[kept * vocab..(kept + 1) * vocab]);
        let (cache, want) = drafts_from_scratch(&model, &context, next, K);
        let got = cache_rows(drafts.cache());
        let d = max_abs_diff(&got, &cache);
        assert!(
            d <= 1e-5,
            "after keeping {kept} drafts, the cache differs by {d}"
        );
        let again = drafts.propose(&model, be, next, context.len(), K).unwrap();
        assert_eq!(again, want, "after keeping {kept} drafts");
    }
}

/// `--draft mtp`: the tokens of plain decoding, greedy (with the last logits bit for bit) and
/// sampled, on the fixture's model and on a preset given a head, with a prompt prefilled in
/// several ubatches (the head's cache takes each one's rows).
#[test]
fn mtp_drafts_keep_the_plain_tokens() {
    let bf16 = LoadOptions {
        weight_dtype: "bf16".into(),
        mtp: true,
        ..Default::default()
    };
    let models = [
        ("fixture", Model::load_dir(&fixture_dir()).unwrap()),
        ("tiny256 bf16", load_model("tiny256", &bf16).unwrap()),
    ];
    let prompt: Vec<u32> = (0..30).map(|i| (i * 37 + 11) % 250).collect();
    let plan = SplitPlan {
        ubatch: 7,
        ..SplitPlan::default()
    };
    let mtp = Drafts {
        kind: DraftKind::Mtp,
        max: 4,
        min: 1,
    };
    for (what, m) in &models {
        let sampled = SamplingParams {
            temperature: 0.9,
            seed: 5,
            ..SamplingParams::greedy()
        };
        for params in [SamplingParams::greedy(), sampled] {
            let run = |drafts: Drafts| {
                let be = &CpuBackend;
                let mut seq = Sequence::typed(&m.config, PAGE, CacheTypes::F32, be).unwrap();
                let mut sampler = Sampler::new(params.clone()).unwrap();
                let mut g = Generation::new(m, be, &mut seq, &mut sampler, Vec::new())
                    .with_drafts(drafts)
                    .unwrap();
                g.limit(40);
                g.prefill(&prompt, &plan).unwrap();
                let tokens: Vec<u32> = (0..40).map(|_| g.next_token().unwrap().unwrap()).collect();
                let stats = g.stats;
                drop(g);
                let last = *tokens.last().unwrap();
                let next = seq.forward(m, be, &[last], Logits::Last, None).unwrap();
                (tokens, next, stats)
            };
            let (want, want_next, _) = run(Drafts::default());
            let (got, got_next, stats) = run(mtp);
            assert_eq!(got, want, "{what}, {params:?}");
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert!(
                bits(&got_next) == bits(&want_next),
                "{what}: the state differs"
            );
            assert!(stats.drafted > 0, "{what}: {stats:?}");
        }
    }
}

/// A server's turns: the head's drafts outlive a generation ([`Generation::take_mtp`]), take
/// the rows of the next turn's prompt after the tokens the generation fed, and rewind with the
/// sequence to a checkpoint (its position and final row). After each, the cache and the next
/// draft are those made from scratch over the same tokens.
#[test]
fn the_heads_drafts_follow_a_conversation() {
    let model = Model::load_dir(&fixture_dir()).unwrap();
    let be = &CpuBackend;
    let vocab = model.config.vocab_size;
    let prompt = reference().ids("tokens");
    const K: usize = 3;
    let mut seq = Sequence::typed(&model.config, PAGE, CacheTypes::F32, be).unwrap();
    let mut sampler = Sampler::new(SamplingParams::greedy()).unwrap();
    let mtp = Drafts {
        kind: DraftKind::Mtp,
        max: K,
        min: 1,
    };
    let mut g = Generation::new(&model, be, &mut seq, &mut sampler, Vec::new())
        .with_drafts(mtp)
        .unwrap();
    g.prefill(&prompt, &SplitPlan::default()).unwrap();
    let first = argmax(g.logits());
    let at_prompt = g.seq.state.checkpoint(be);
    let mut drafts = g.take_mtp().unwrap();
    let prompt_row = drafts.last_row().unwrap().to_vec();
    g = g.with_mtp(drafts).unwrap();
    for _ in 0..9 {
        g.next_token().unwrap().unwrap();
    }
    let fed = g.context().to_vec();
    drafts = g.take_mtp().unwrap();
    drop(g);
    assert!(fed.len() > prompt.len() && fed.starts_with(&prompt));

    // The next turn: its prompt extends what the sequence fed.
    let turn: Vec<u32> = [&fed[..], &[3, 1, 4, 1, 5]].concat();
    let (hidden, logits) = seq.forward_rows(&model, be, &turn[fed.len()..]).unwrap();
    drafts
        .take_rows(&model, be, &hidden, fed.len(), &turn)
        .unwrap();
    let next = argmax(&logits[logits.len() - vocab..]);
    let (cache, want) = drafts_from_scratch(&model, &turn, next, K);
    let d = max_abs_diff(&cache_rows(drafts.cache()), &cache);
    assert!(
        d <= 1e-5,
        "after the next turn's prompt the cache differs by {d}"
    );
    let got = drafts.propose(&model, be, next, turn.len(), K).unwrap();
    assert_eq!(got, want, "after the next turn's prompt");

    // Back to the first prompt's end, as a conversation cache restores it.
    seq.rewind(be, &at_prompt).unwrap();
    drafts.rewind(be, prompt.len(), Some(prompt_row)).unwrap();
    let (cache, want) = drafts_from_scratch(&model, &prompt, first, K);
    assert_eq!(cache_rows(drafts.cache()), cache);
    let got = drafts.propose(&model, be, first, prompt.len(), K).unwrap();
    assert_eq!(got, want, "after the rewind");
    // A rewind the head cannot follow is refused.
    assert!(drafts.rewind(be, prompt.len() + 5, None).is_err());
}
