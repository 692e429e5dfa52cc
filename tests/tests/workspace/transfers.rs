//! What crosses between host and device in a decode step: the step's
//! metadata goes up in one copy and the logits come down in one, whatever
//! the architecture, its number of layers and experts, or the batch size
//! (counted by the backend's hooks).

use anyhow::Result;
use metrale_gpu_runtime::gpu::GpuBackend;
use metrale_model_engine::model::{Logits, Step};
use metrale_tests::*;

#[test]
fn a_decode_step_uploads_once_and_downloads_once() -> Result<()> {
    for name in MODELS {
        let (cpu, model) = load(name)?;
        let layers = model.config().layers.len();
        let experts = model.config().moe.as_ref().map_or(0, |m| m.n_experts);
        let mut ops_per_step = None;
        for batch in [1usize, 8] {
            let mut seqs = (0..batch)
                .map(|_| model.new_sequence())
                .collect::<Result<Vec<_>, _>>()?;
            // Prefill each sequence with a prompt of its own length.
            for (i, seq) in seqs.iter_mut().enumerate() {
                let prompt: Vec<u32> = (0..3 + i as u32).collect();
                run_chunked(&model, seq, &prompt, prompt.len())?;
            }
            let next: Vec<u32> = (0..batch as u32).map(|i| 5 + i).collect();
            let mut steps: Vec<Step<'_>> = seqs
                .iter_mut()
                .zip(&next)
                .map(|(seq, t)| Step {
                    seq,
                    tokens: std::slice::from_ref(t),
                    logits: Logits::Last,
                })
                .collect();
            cpu.hooks().reset_transfers();
            let logits = model.forward(&mut steps)?;
            let t = cpu.hooks().transfers();
            drop(steps);
            eprintln!(
                "{name} ({layers} layers, {experts} experts), batch {batch}: \
                 {} upload(s) of {} bytes, {} download(s) of {} bytes, {} ops, \
                 {} device copies, {} memsets",
                t.h2d_copies,
                t.h2d_bytes,
                t.d2h_copies,
                t.d2h_bytes,
                t.op_launches,
                t.d2d_copies,
                t.memsets
            );
            assert_eq!(t.h2d_copies, 1, "{name} batch {batch}: uploads");
            assert_eq!(t.d2h_copies, 1, "{name} batch {batch}: downloads");
            let vocab = model.config().vocab_size;
            assert_eq!(t.d2h_bytes as usize, batch * vocab * 4);
            // The same ops for any batch (what a CUDA graph per batch-size
            // bucket relies on).
            assert_eq!(
                *ops_per_step.get_or_insert(t.op_launches),
                t.op_launches,
                "{name}: ops per decode step depend on the batch"
            );
            assert!(logits.iter().all(|l| l.len() == vocab));
            for seq in seqs {
                model.free_sequence(seq);
            }
        }
        model.shutdown()?;
        assert_eq!(cpu.live_bytes(), 0);
    }
    Ok(())
}
