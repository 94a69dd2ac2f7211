#!/usr/bin/env python3
"""A GGUF file against llama.cpp's layout for its architecture, read by llama.cpp's own gguf-py
(`pip install gguf`): every tensor a name llama.cpp knows for the arch (gguf-py's MODEL_TENSORS,
the list llama-arch.cpp's LLM_TENSOR names mirror), every tensor llama.cpp's loader requires
present with the shape it asks for (src/models/deepseek2.cpp, glm4-moe.cpp and gemma4.cpp,
`create_tensor`),
no tensor it would not load (its "wrong number of tensors" check), and the metadata it reads.

  gguf-layout-check.py FILE [--json]
  gguf-layout-check.py --self-test    (a file in the old mixed form fails, naming what is wrong)

Covers deepseek2 (split `attn_k_b`/`attn_v_b`, or the older fused `attn_kv_b` without
`key_length_mla`), glm4moe (NextN/MTP layers included) and gemma4 (sliding and global layers
of their own sizes, keys as values where `attn_v` is absent, `rope_freqs`, fused or split
expert gate/up, the router's and experts' scales). Prints one line per problem and a
summary; exits 1 on any problem, 2 when gguf-py is missing."""
import json
import sys

try:
    import gguf
    from gguf.constants import MODEL_ARCH, MODEL_TENSORS, TENSOR_NAMES
except ImportError:
    print("gguf-py is not installed (pip install gguf)")
    sys.exit(2)

ARCHS = {"deepseek2": MODEL_ARCH.DEEPSEEK2, "glm4moe": MODEL_ARCH.GLM4_MOE, "gemma4": MODEL_ARCH.GEMMA4}
# llama.cpp's NextN tensors: loaded for the MTP layers of both loaders (deepseek2.cpp reads them
# too, though gguf-py's DEEPSEEK2 list lacks them).
NEXTN = ["nextn.eh_proj", "nextn.enorm", "nextn.hnorm", "nextn.embed_tokens", "nextn.shared_head_head",
         "nextn.shared_head_norm"]


class Meta:
    def __init__(self, reader, arch):
        self.reader, self.arch = reader, arch

    def get(self, key, default=None):
        field = self.reader.get_field(f"{self.arch}.{key}" if not key.startswith(("general.", "tokenizer.")) else key)
        if field is None:
            return default
        value = field.contents()
        return value

    def need(self, key, problems):
        value = self.get(key)
        if value is None:
            problems.append(f"missing metadata {self.arch}.{key} (llama.cpp's loader requires it)")
        return value


def ne(reader):
    """name -> ggml shape (ne: the fastest dimension first), as llama.cpp's create_tensor checks."""
    return {t.name: [int(d) for d in t.shape] for t in reader.tensors}


def deepseek2_expected(m, problems):
    n_layer_all = m.need("block_count", problems) or 0
    nextn = m.get("nextn_predict_layers", 0)
    n_layer = n_layer_all - nextn
    n_embd = m.need("embedding_length", problems)
    n_head = m.need("attention.head_count", problems)
    n_ff = m.get("feed_forward_length")
    kv_rank = m.need("attention.kv_lora_rank", problems)
    q_rank = m.get("attention.q_lora_rank", 0)
    rope = m.need("rope.dimension_count", problems)
    k_mla, v_mla = m.get("attention.key_length_mla"), m.get("attention.value_length_mla")
    is_mla = k_mla is not None and v_mla is not None
    if (k_mla is None) != (v_mla is None):
        problems.append("key_length_mla and value_length_mla: one without the other")
    head_k = k_mla if is_mla else m.need("attention.key_length", problems)
    head_v = v_mla if is_mla else m.need("attention.value_length", problems)
    if is_mla:
        # MQA over the latent: one KV head of kv_lora_rank + rope.
        if m.get("attention.head_count_kv") != 1:
            problems.append(f"head_count_kv {m.get('attention.head_count_kv')}: llama.cpp's MLA form has 1")
        if m.get("attention.key_length") != kv_rank + rope or m.get("attention.value_length") != kv_rank:
            problems.append("key_length/value_length are not kv_lora_rank + rope / kv_lora_rank")
    if n_layer not in (26, 27) and not q_rank:
        problems.append("no attention.q_lora_rank: llama.cpp requires it outside its 'lite' layer counts")
    n_expert = m.need("expert_count", problems)
    m.need("expert_used_count", problems)
    ff_exp = m.need("expert_feed_forward_length", problems)
    shared = m.need("expert_shared_count", problems)
    dense = m.get("leading_dense_block_count", 0)
    m.need("attention.layer_norm_rms_epsilon", problems)
    if m.get("expert_gating_func") not in (1, 2):
        problems.append(f"expert_gating_func {m.get('expert_gating_func')}: deepseek2 without it means softmax")
    if None in (n_embd, n_head, kv_rank, rope, head_k, head_v, n_expert, ff_exp, shared):
        return {}, set()
    nope = head_k - rope
    want, optional = {"token_embd.weight": [n_embd, None], "output_norm.weight": [n_embd]}, {"output.weight"}
    want["output.weight"] = [n_embd, None]
    for i in range(n_layer_all):
        b = f"blk.{i}."
        want[b + "attn_norm.weight"] = [n_embd]
        want[b + "attn_kv_a_norm.weight"] = [kv_rank]
        if q_rank:
            want[b + "attn_q_a_norm.weight"] = [q_rank]
            want[b + "attn_q_a.weight"] = [n_embd, q_rank]
            want[b + "attn_q_b.weight"] = [q_rank, n_head * head_k]
        else:
            want[b + "attn_q.weight"] = [n_embd, n_head * head_k]
        want[b + "attn_kv_a_mqa.weight"] = [n_embd, kv_rank + rope]
        if is_mla:
            want[b + "attn_k_b.weight"] = [nope, kv_rank, n_head]
            want[b + "attn_v_b.weight"] = [kv_rank, head_v, n_head]
        else:
            want[b + "attn_kv_b.weight"] = [kv_rank, n_head * (nope + head_v)]
        want[b + "attn_output.weight"] = [n_head * head_v, n_embd]
        want[b + "ffn_norm.weight"] = [n_embd]
        if i < dense:
            for p, s in (("gate", [n_embd, n_ff]), ("down", [n_ff, n_embd]), ("up", [n_embd, n_ff])):
                want[b + f"ffn_{p}.weight"] = s
        else:
            moe_tensors(want, optional, b, n_embd, n_expert, ff_exp, shared, bias_required=False)
        if i >= n_layer:
            nextn_tensors(want, optional, b, n_embd)
    return want, optional


def moe_tensors(want, optional, b, n_embd, n_expert, ff_exp, shared, bias_required):
    want[b + "ffn_gate_inp.weight"] = [n_embd, n_expert]
    want[b + "exp_probs_b.bias"] = [n_expert]
    if not bias_required:
        optional.add(b + "exp_probs_b.bias")
    want[b + "ffn_gate_exps.weight"] = [n_embd, ff_exp, n_expert]
    want[b + "ffn_up_exps.weight"] = [n_embd, ff_exp, n_expert]
    want[b + "ffn_down_exps.weight"] = [ff_exp, n_embd, n_expert]
    if shared:
        want[b + "ffn_gate_shexp.weight"] = [n_embd, ff_exp * shared]
        want[b + "ffn_up_shexp.weight"] = [n_embd, ff_exp * shared]
        want[b + "ffn_down_shexp.weight"] = [ff_exp * shared, n_embd]


def nextn_tensors(want, optional, b, n_embd):
    want[b + "nextn.eh_proj.weight"] = [2 * n_embd, n_embd]
    want[b + "nextn.enorm.weight"] = [n_embd]
    want[b + "nextn.hnorm.weight"] = [n_embd]
    for name, shape in (("embed_tokens", [n_embd, None]), ("shared_head_head", [n_embd, None]),
                        ("shared_head_norm", [n_embd])):
        want[b + f"nextn.{name}.weight"] = shape
        optional.add(b + f"nextn.{name}.weight")


def glm4moe_expected(m, problems):
    n_layer_all = m.need("block_count", problems) or 0
    nextn = m.get("nextn_predict_layers", 0)
    n_layer = n_layer_all - nextn
    n_embd = m.need("embedding_length", problems)
    n_head = m.need("attention.head_count", problems)
    n_head_kv = m.get("attention.head_count_kv", n_head)
    head = m.get("attention.key_length", (n_embd or 0) // max(n_head or 1, 1))
    n_ff = m.get("feed_forward_length")
    n_expert = m.need("expert_count", problems)
    m.need("expert_used_count", problems)
    ff_exp = m.need("expert_feed_forward_length", problems)
    shared = m.need("expert_shared_count", problems)
    dense = m.get("leading_dense_block_count", 0)
    m.need("attention.layer_norm_rms_epsilon", problems)
    if m.get("expert_gating_func", 2) != 2:
        problems.append(f"expert_gating_func {m.get('expert_gating_func')}: GLM-4.5 routes by sigmoid (2)")
    if None in (n_embd, n_head, n_expert, ff_exp, shared):
        return {}, set()
    want = {"token_embd.weight": [n_embd, None], "output_norm.weight": [n_embd], "output.weight": [n_embd, None]}
    optional = {"output.weight"}
    for i in range(n_layer_all):
        b = f"blk.{i}."
        want[b + "attn_norm.weight"] = [n_embd]
        for p, rows in (("q", n_head * head), ("k", n_head_kv * head), ("v", n_head_kv * head)):
            want[b + f"attn_{p}.weight"] = [n_embd, rows]
            want[b + f"attn_{p}.bias"] = [rows]
            optional.add(b + f"attn_{p}.bias")
        want[b + "attn_output.weight"] = [n_head * head, n_embd]
        for p in ("q", "k"):
            want[b + f"attn_{p}_norm.weight"] = [head]
            optional.add(b + f"attn_{p}_norm.weight")
        want[b + "post_attention_norm.weight"] = [n_embd]
        if i >= dense:
            moe_tensors(want, optional, b, n_embd, n_expert, ff_exp, shared, bias_required=True)
        else:
            for p, s in (("gate", [n_embd, n_ff]), ("down", [n_ff, n_embd]), ("up", [n_embd, n_ff])):
                want[b + f"ffn_{p}.weight"] = s
        if i >= n_layer:
            nextn_tensors(want, optional, b, n_embd)
    return want, optional


def gemma4_expected(m, problems):
    """src/models/gemma4.cpp's load_arch_tensors (and its hparams: llama.cpp requires
    embedding_length_per_layer_input and the *_swa head sizes)."""
    n_layer = m.need("block_count", problems) or 0
    n_embd = m.need("embedding_length", problems)
    n_head = m.need("attention.head_count", problems)
    head_full = m.need("attention.key_length", problems)
    head_swa = m.need("attention.key_length_swa", problems)
    if m.get("attention.value_length", head_full) != head_full or m.get("attention.value_length_swa", head_swa) != head_swa:
        problems.append("value_length(_swa) differs from key_length(_swa): Gemma 4 requires them equal")
    pattern = m.need("attention.sliding_window_pattern", problems)
    m.need("attention.sliding_window", problems)
    m.need("attention.layer_norm_rms_epsilon", problems)
    per_layer = m.need("embedding_length_per_layer_input", problems)
    if per_layer:
        problems.append(f"embedding_length_per_layer_input {per_layer}: this check covers 0 (no per-layer embeddings)")
    kv = m.need("attention.head_count_kv", problems)
    n_ff = m.need("feed_forward_length", problems)
    n_expert = m.get("expert_count", 0)
    ff_exp = m.get("expert_feed_forward_length")
    if None in (n_embd, n_head, head_full, head_swa, pattern, kv, n_ff):
        return {}, set()
    if len(pattern) != n_layer:
        problems.append(f"sliding_window_pattern has {len(pattern)} entries for {n_layer} layers")
        return {}, set()
    kv = kv if isinstance(kv, list) else [kv] * n_layer
    if m.get("rope.dimension_count", head_full) != head_full:
        problems.append("rope.dimension_count is not key_length (proportional RoPE turns pairs by rope_freqs)")
    want = {"token_embd.weight": [n_embd, None], "output_norm.weight": [n_embd], "output.weight": [n_embd, None]}
    optional = {"output.weight"}
    for i in range(n_layer):
        b, head = f"blk.{i}.", head_swa if pattern[i] else head_full
        want[b + "attn_norm.weight"] = [n_embd]
        want[b + "attn_q.weight"] = [n_embd, n_head * head]
        want[b + "attn_k.weight"] = [n_embd, kv[i] * head]
        want[b + "attn_v.weight"] = [n_embd, kv[i] * head]
        optional.add(b + "attn_v.weight")
        want[b + "attn_output.weight"] = [n_head * head, n_embd]
        want[b + "attn_q_norm.weight"] = [head]
        want[b + "attn_k_norm.weight"] = [head]
        want[b + "post_attention_norm.weight"] = [n_embd]
        want[b + "layer_output_scale.weight"] = [1]
        optional.add(b + "layer_output_scale.weight")
        if not pattern[i]:
            want["rope_freqs.weight"] = [head_full // 2]
        for name, shape in (("ffn_norm", [n_embd]), ("ffn_gate", [n_embd, n_ff]), ("ffn_up", [n_embd, n_ff]),
                            ("ffn_down", [n_ff, n_embd]), ("post_ffw_norm", [n_embd])):
            want[b + name + ".weight"] = shape
        if n_expert and ff_exp:
            gemma4_moe(want, optional, b, n_embd, n_expert, ff_exp)
    return want, optional


def gemma4_moe(want, optional, b, n_embd, n_expert, ff_exp):
    """A Gemma 4 MoE layer (llama.cpp: a layer with ffn_gate_inp): router, its input scale, the
    branch norms, the experts (gate/up fused or split) and their per-expert scale."""
    want[b + "ffn_gate_inp.weight"] = [n_embd, n_expert]
    optional.add(b + "ffn_gate_inp.weight")
    want[b + "ffn_gate_inp.scale"] = [n_embd]
    for name in ("pre_ffw_norm_2", "post_ffw_norm_1", "post_ffw_norm_2"):
        want[b + name + ".weight"] = [n_embd]
    want[b + "ffn_gate_up_exps.weight"] = [n_embd, 2 * ff_exp, n_expert]
    want[b + "ffn_gate_exps.weight"] = [n_embd, ff_exp, n_expert]
    want[b + "ffn_up_exps.weight"] = [n_embd, ff_exp, n_expert]
    optional.update(b + f"ffn_{p}_exps.weight" for p in ("gate_up", "gate", "up"))
    want[b + "ffn_down_exps.weight"] = [ff_exp, n_embd, n_expert]
    want[b + "ffn_down_exps.scale"] = [n_expert]
    optional.add(b + "ffn_down_exps.scale")


def gemma4_experts_present(have, n_layer, problems):
    """Each MoE layer's experts: fused gate/up or both split ones (llama.cpp loads the split
    pair only without the fused tensor)."""
    for i in range(n_layer):
        b = f"blk.{i}."
        if b + "ffn_gate_inp.weight" not in have:
            continue
        fused = b + "ffn_gate_up_exps.weight" in have
        split = [b + f"ffn_{p}_exps.weight" in have for p in ("gate", "up")]
        if fused and any(split):
            problems.append(f"{b}ffn_gate_up_exps with split gate/up: llama.cpp does not load the split ones")
        elif not fused and not all(split):
            problems.append(f"{b}experts: neither ffn_gate_up_exps nor both ffn_gate_exps and ffn_up_exps")


def known_names(arch, n_layer_all):
    names = set()
    for t in MODEL_TENSORS[ARCHS[arch]]:
        fmt = TENSOR_NAMES[t]
        names.update(fmt.format(bid=i) for i in range(n_layer_all)) if "{bid}" in fmt else names.add(fmt)
    names.update(f"blk.{i}.{n}" for i in range(n_layer_all) for n in NEXTN)
    return names


def check(path):
    reader = gguf.GGUFReader(path)
    arch_field = reader.get_field("general.architecture")
    arch = arch_field.contents() if arch_field else None
    problems = []
    if arch not in ARCHS:
        return arch, [f"general.architecture {arch!r}: this check knows {sorted(ARCHS)}"], 0
    m = Meta(reader, arch)
    expected = {"deepseek2": deepseek2_expected, "glm4moe": glm4moe_expected, "gemma4": gemma4_expected}
    want, optional = expected[arch](m, problems)
    have = ne(reader)
    known = known_names(arch, m.get("block_count", 0))
    if arch == "gemma4":
        # gguf-py's GEMMA4 list has the fused gate/up only; llama.cpp's loader also reads split.
        known.update(f"blk.{i}.ffn_{p}_exps" for i in range(m.get("block_count", 0)) for p in ("gate", "up"))
        gemma4_experts_present(have, m.get("block_count", 0), problems)
    for name, shape in have.items():
        base = name.rsplit(".", 1)[0]
        if base not in known:
            problems.append(f"{name}: not a tensor name llama.cpp knows for {arch}")
        elif name not in want:
            problems.append(f"{name}: llama.cpp's loader does not load it (its tensor count check fails)")
    for name, shape in want.items():
        got = have.get(name)
        if got is None:
            if name not in optional:
                problems.append(f"{name}: missing (llama.cpp's loader requires it)")
            continue
        if len(got) != len(shape) or any(w is not None and w != g for w, g in zip(shape, got)):
            problems.append(f"{name}: ne {got}, llama.cpp expects {shape}")
    return arch, problems, len(have)


def self_test():
    """A one-layer deepseek2 file as this repository's writer once made it (key_length_mla with a
    fused attn_kv_b) and without q_lora_rank: each problem is named."""
    import os
    import tempfile
    import numpy as np
    path = os.path.join(tempfile.mkdtemp(), "old.gguf")
    w = gguf.GGUFWriter(path, "deepseek2")
    for key, value in (("block_count", 1), ("embedding_length", 8), ("attention.head_count", 2),
                       ("attention.head_count_kv", 1), ("attention.kv_lora_rank", 4),
                       ("rope.dimension_count", 2), ("attention.key_length_mla", 6),
                       ("attention.value_length_mla", 4), ("attention.key_length", 6),
                       ("attention.value_length", 4), ("expert_count", 2), ("expert_used_count", 1),
                       ("expert_feed_forward_length", 4), ("expert_shared_count", 0),
                       ("expert_gating_func", 2)):
        w.add_uint32(f"deepseek2.{key}", value)
    w.add_float32("deepseek2.attention.layer_norm_rms_epsilon", 1e-6)
    shapes = {"token_embd.weight": (16, 8), "output_norm.weight": (8,), "blk.0.attn_norm.weight": (8,),
              "blk.0.attn_kv_a_norm.weight": (4,), "blk.0.attn_q.weight": (12, 8),
              "blk.0.attn_kv_a_mqa.weight": (6, 8), "blk.0.attn_kv_b.weight": (16, 4),
              "blk.0.attn_output.weight": (8, 8), "blk.0.ffn_norm.weight": (8,),
              "blk.0.ffn_gate_inp.weight": (2, 8), "blk.0.ffn_gate_exps.weight": (2, 4, 8),
              "blk.0.ffn_up_exps.weight": (2, 4, 8), "blk.0.ffn_down_exps.weight": (2, 8, 4),
              "blk.0.attn_bogus.weight": (8,)}
    for name, shape in shapes.items():
        w.add_tensor(name, np.zeros(shape, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _, problems, _ = check(path)
    text = "\n".join(problems)
    expected = ["attn_kv_b.weight: llama.cpp's loader does not load it", "attn_k_b.weight: missing",
                "attn_v_b.weight: missing", "no attention.q_lora_rank",
                "attn_bogus.weight: not a tensor name llama.cpp knows"]
    missed = [e for e in expected if e not in text]
    print(text)
    print(f"self-test: {'ok' if not missed else f'FAIL, not reported: {missed}'}")
    return 1 if missed else 0


def main(argv):
    if argv[:1] == ["--self-test"]:
        return self_test()
    path = argv[0]
    arch, problems, n = check(path)
    if "--json" in argv:
        print(json.dumps({"file": path, "arch": arch, "tensors": n, "problems": problems}))
    else:
        for p in problems:
            print(f"{path}: {p}")
        print(f"{path}: {arch}, {n} tensors: {'ok' if not problems else f'{len(problems)} problems'}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
