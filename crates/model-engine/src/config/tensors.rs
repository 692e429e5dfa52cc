//! The tensors a [`ModelConfig`] needs, with their shapes (PyTorch layout:
//! a linear layer's weight is `[out, in]`).

use super::{
    AttentionNames, DeltaNetNames, DeltaProjNames, ExpertNames, FfnNames, LayerNames, MambaNames,
    MixerNames, MlpNames, ModelConfig, MoeNames, ShortConvNames, TensorSpec, bias_of,
};

impl ModelConfig {
    /// Every tensor the checkpoint must hold, with its shape: the
    /// embedding, each layer's, the final norm, and `lm_head` only when the
    /// head is not tied to the embedding.
    pub fn expected_tensors(&self) -> Vec<TensorSpec> {
        let h = self.hidden_size;
        let mut out = Vec::new();
        let mut push = |name: &str, shape: Vec<usize>| {
            out.push(TensorSpec {
                name: name.to_string(),
                shape,
            })
        };
        push(&self.names.embed, vec![self.vocab_size, h]);
        for layer in &self.layers {
            self.layer_tensors(&layer.names, &mut push);
        }
        push(&self.names.final_norm, vec![h]);
        if let Some(head) = &self.names.lm_head {
            push(head, vec![self.vocab_size, h]);
        }
        out
    }

    /// The tensors of one layer named by `names` (with this config's
    /// shapes), such as a multi-token prediction layer's.
    pub fn layer_specs(&self, names: &LayerNames) -> Vec<TensorSpec> {
        let mut out = Vec::new();
        self.layer_tensors(names, &mut |name: &str, shape: Vec<usize>| {
            out.push(TensorSpec {
                name: name.to_string(),
                shape,
            })
        });
        out
    }

    /// Parameters over all expected tensors.
    pub fn parameter_count(&self) -> usize {
        self.expected_tensors()
            .iter()
            .map(|t| t.shape.iter().product::<usize>())
            .sum()
    }

    fn layer_tensors(&self, names: &LayerNames, push: &mut impl FnMut(&str, Vec<usize>)) {
        let h = self.hidden_size;
        push(&names.input_norm, vec![h]);
        match &names.mixer {
            MixerNames::Attention(a) => self.attention_tensors(a, push),
            MixerNames::Mamba2(m) => self.mamba_tensors(m, push),
            MixerNames::GatedDeltaNet(d) => self.deltanet_tensors(d, push),
            MixerNames::ShortConv(c) => self.short_conv_tensors(c, push),
            MixerNames::None => {}
        }
        if let Some(norm) = &names.ffn_norm {
            push(norm, vec![h]);
        }
        match &names.ffn {
            FfnNames::Mlp(m) => {
                let inter = self.mlp.as_ref().map_or(0, |c| c.intermediate_size);
                mlp_tensors(m, h, inter, push);
            }
            FfnNames::Moe(m) => self.moe_tensors(m, push),
            FfnNames::None => {}
        }
    }

    fn attention_tensors(&self, n: &AttentionNames, push: &mut impl FnMut(&str, Vec<usize>)) {
        let Some(a) = &self.attention else { return };
        let h = self.hidden_size;
        let q_rows = if a.output_gate {
            2 * a.q_width()
        } else {
            a.q_width()
        };
        push(&n.q, vec![q_rows, h]);
        push(&n.k, vec![a.kv_width(), h]);
        push(&n.v, vec![a.kv_width(), h]);
        push(&n.o, vec![h, a.q_width()]);
        let biases = [
            (&n.q_bias, q_rows),
            (&n.k_bias, a.kv_width()),
            (&n.v_bias, a.kv_width()),
            (&n.o_bias, h),
        ];
        for (name, len) in biases {
            if let Some(name) = name {
                push(name, vec![len]);
            }
        }
        for norm in [&n.q_norm, &n.k_norm].into_iter().flatten() {
            push(norm, vec![a.head_dim]);
        }
    }

    fn mamba_tensors(&self, n: &MambaNames, push: &mut impl FnMut(&str, Vec<usize>)) {
        let Some(m) = &self.mamba else { return };
        let h = self.hidden_size;
        push(&n.in_proj, vec![m.in_proj_dim(), h]);
        if let Some(b) = &n.in_proj_bias {
            push(b, vec![m.in_proj_dim()]);
        }
        push(&n.conv_weight, vec![m.conv_dim(), 1, m.conv_kernel]);
        if let Some(b) = &n.conv_bias {
            push(b, vec![m.conv_dim()]);
        }
        push(&n.dt_bias, vec![m.n_heads]);
        push(&n.a_log, vec![m.n_heads]);
        push(&n.d, vec![m.n_heads]);
        push(&n.norm, vec![m.d_inner()]);
        push(&n.out_proj, vec![h, m.d_inner()]);
        if let Some(b) = &n.out_proj_bias {
            push(b, vec![h]);
        }
    }

    fn deltanet_tensors(&self, n: &DeltaNetNames, push: &mut impl FnMut(&str, Vec<usize>)) {
        let Some(d) = &self.deltanet else { return };
        let h = self.hidden_size;
        match &n.proj {
            DeltaProjNames::Grouped { qkvz, ba } => {
                push(qkvz, vec![d.conv_dim() + d.value_dim(), h]);
                push(ba, vec![2 * d.n_v_heads, h]);
            }
            DeltaProjNames::Split { qkv, z, b, a } => {
                push(qkv, vec![d.conv_dim(), h]);
                push(z, vec![d.value_dim(), h]);
                push(b, vec![d.n_v_heads, h]);
                push(a, vec![d.n_v_heads, h]);
            }
        }
        push(&n.conv_weight, vec![d.conv_dim(), 1, d.conv_kernel]);
        push(&n.dt_bias, vec![d.n_v_heads]);
        push(&n.a_log, vec![d.n_v_heads]);
        push(&n.norm, vec![d.v_head_dim]);
        push(&n.out_proj, vec![h, d.value_dim()]);
    }

    fn short_conv_tensors(&self, n: &ShortConvNames, push: &mut impl FnMut(&str, Vec<usize>)) {
        let Some(c) = &self.short_conv else { return };
        let h = self.hidden_size;
        push(&n.in_proj, vec![3 * h, h]);
        push(&n.conv_weight, vec![h, 1, c.kernel]);
        push(&n.out_proj, vec![h, h]);
        if n.bias {
            push(&bias_of(&n.in_proj), vec![3 * h]);
            push(&bias_of(&n.conv_weight), vec![h]);
            push(&bias_of(&n.out_proj), vec![h]);
        }
    }

    fn moe_tensors(&self, n: &MoeNames, push: &mut impl FnMut(&str, Vec<usize>)) {
        let Some(m) = &self.moe else { return };
        let h = self.hidden_size;
        let e = m.n_experts;
        let inter = m.expert_intermediate;
        push(&n.router, vec![e, h]);
        if let Some(b) = &n.router_bias {
            push(b, vec![e]);
        }
        match &n.experts {
            ExpertNames::Separate(experts) => {
                experts.iter().for_each(|x| mlp_tensors(x, h, inter, push))
            }
            ExpertNames::Fused { gate_up, down } => {
                push(gate_up, vec![e, 2 * inter, h]);
                push(down, vec![e, h, inter]);
            }
        }
        if let (Some(shared), Some(si)) = (&n.shared, m.shared_intermediate) {
            mlp_tensors(shared, h, si, push);
        }
        if let Some(g) = &n.shared_gate {
            push(g, vec![1, h]);
        }
    }
}

fn mlp_tensors(n: &MlpNames, h: usize, inter: usize, push: &mut impl FnMut(&str, Vec<usize>)) {
    match n {
        MlpNames::Split {
            gate,
            up,
            down,
            bias,
        } => {
            push(gate, vec![inter, h]);
            push(up, vec![inter, h]);
            push(down, vec![h, inter]);
            if *bias {
                push(&bias_of(gate), vec![inter]);
                push(&bias_of(up), vec![inter]);
                push(&bias_of(down), vec![h]);
            }
        }
        MlpNames::Fused { gate_up, down } => {
            push(gate_up, vec![2 * inter, h]);
            push(down, vec![h, inter]);
        }
        MlpNames::Plain { up, down, bias } => {
            push(up, vec![inter, h]);
            push(down, vec![h, inter]);
            if *bias {
                push(&bias_of(up), vec![inter]);
                push(&bias_of(down), vec![h]);
            }
        }
    }
}
