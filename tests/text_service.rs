//! The library's async embedding API ([`TextGenerator`]) runs requests together (continuous
//! batching): concurrent requests each get the tokens and text they get alone, a stop string
//! ends its request only, a dropped reader cancels its request only.

mod common;

use moe_lanes::engine::{build_engine, BatchOptions, EngineKind, EngineOptions, GenerationOptions};
use moe_lanes::model::Model;
use moe_lanes::synth::SynthFormat;
use moe_lanes::text::{TextEvent, TextFinish, TextGenerator, TextOptions};
use std::sync::Arc;

fn options() -> EngineOptions {
    let mut opts = EngineOptions::new(256);
    opts.kind = Some(EngineKind::Pipeline);
    opts.cold_threads = moe_lanes::threads::ColdThreads::Fixed(1);
    opts
}

#[test]
fn concurrent_requests_get_what_each_gets_alone() {
    let dir = tempfile::tempdir().unwrap();
    let path = common::synth_tiny(dir.path(), "qwen3_moe", SynthFormat::Gguf, 5);
    let model = Arc::new(Model::open(&path).unwrap());
    let prompts: Vec<Vec<u32>> =
        (0..5).map(|i| (0..(3 + 4 * i)).map(|j| (17 + 13 * j + 7 * i) as u32 % 200).collect()).collect();
    let n_new = |i: usize| 4 + 3 * i;
    let want: Vec<Vec<u32>> = {
        let (mut engine, _) = build_engine(&model, options()).unwrap();
        prompts.iter().enumerate().map(|(i, p)| engine.generate(p, n_new(i)).unwrap()).collect()
    };
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    rt.block_on(async {
        let batch = BatchOptions { max_sequences: 3, step_tokens: 8, prefix_cache: 0, ..Default::default() };
        let generator = TextGenerator::start_batched(model.clone(), options(), batch).await.unwrap();
        let opts = |i: usize| TextOptions {
            generation: GenerationOptions { max_tokens: n_new(i), ..Default::default() },
            ..Default::default()
        };
        // One more request whose reader goes away at once: it is cancelled, the others go on.
        let dropped = generator.generate_ids(prompts[4].clone(), opts(4));
        let streams: Vec<_> = (0..5).map(|i| generator.generate_ids(prompts[i].clone(), opts(i))).collect();
        drop(dropped);
        let mut handles = Vec::new();
        for s in streams {
            handles.push(tokio::spawn(async move { s.collect().await }));
        }
        for (i, h) in handles.into_iter().enumerate() {
            let outcome = h.await.unwrap().unwrap();
            let ids: Vec<u32> = outcome.tokens.iter().map(|t| t.id).collect();
            assert_eq!(ids, want[i], "request {i}");
            assert_eq!(outcome.finish, TextFinish::Length);
            assert_eq!(outcome.prompt_tokens, prompts[i].len());
        }
        // A stop string made of a request's own text ends it there.
        let full = generator.generate_ids(prompts[1].clone(), opts(1)).collect().await.unwrap();
        let cut: String = full.text.chars().skip(1).take(2).collect();
        if !cut.is_empty() {
            let mut o = opts(1);
            o.stop_strings = vec![cut.clone()];
            let mut events = generator.generate_ids(prompts[1].clone(), o);
            let mut done = None;
            while let Some(e) = events.next().await {
                if let TextEvent::Done(outcome) = e {
                    done = Some(outcome);
                }
            }
            let done = done.expect("a Done event");
            assert_eq!(done.finish, TextFinish::StopString { index: 0 });
            assert!(
                full.text.starts_with(&done.text) && !done.text.contains(&cut),
                "{:?} / {:?}",
                done.text,
                full.text
            );
        }
    });
}

/// A GPT-OSS model's chat through the generator is parsed as Harmony: the outcome's text and
/// reasoning are what `parse_harmony` makes of its tokens (a random model's output is mostly
/// malformed Harmony, which is content); a plain generation of the same model is not parsed.
#[test]
fn a_gpt_oss_chat_is_parsed_as_harmony() {
    use moe_lanes::text::{parse_harmony, ChatMessage, HarmonyTokens};
    let dir = tempfile::tempdir().unwrap();
    let path = common::synth_tiny(dir.path(), "gpt_oss", SynthFormat::Gguf, 7);
    let model = Arc::new(Model::open(&path).unwrap());
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    rt.block_on(async {
        let generator = TextGenerator::start(model.clone(), options()).await.unwrap();
        let template = generator.chat_template().expect("GPT-OSS has the built-in template").unwrap();
        let tok = generator.tokenizer().clone();
        let tokens = HarmonyTokens::of(&tok).unwrap();
        assert_eq!(generator.harmony(), Some(tokens));
        let opts = generator.options(24);
        let outcome =
            generator.chat(&template, &[ChatMessage::user("Hi")], opts.clone()).collect().await.unwrap();
        let ids: Vec<u32> = outcome.tokens.iter().map(|t| t.id).collect();
        let want = parse_harmony(&tok, tokens, &ids).unwrap().texts();
        assert_eq!(
            (outcome.text.as_str(), outcome.reasoning.as_str()),
            (want.content.as_str(), want.reasoning.as_str())
        );
        let plain = generator.generate_ids(ids.clone(), opts).collect().await.unwrap();
        assert!(plain.reasoning.is_empty(), "only chats are parsed");
    });
}
