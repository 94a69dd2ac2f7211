// llama-argmax MODEL NGL TOKENS [LOGITS_OUT]
//   MODEL   a GGUF file; NGL  layers on the GPU (0 = CPU only); TOKENS  comma-separated ids;
//   LOGITS_OUT  where to write every position's logits (little-endian f32, a row per position).
// Decodes the tokens in one batch with logits for every position and prints one JSON object:
// {"argmax": [...], "gap": [...]} (per position: the top logit's id and its lead over the second).
#include "llama.h"

#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

static std::vector<llama_token> parse_tokens(const char * s) {
    std::vector<llama_token> out;
    std::stringstream in(s);
    std::string item;
    while (std::getline(in, item, ',')) {
        if (!item.empty()) out.push_back((llama_token) std::stol(item));
    }
    return out;
}

static void top2(const float * row, int n, int & best, float & gap) {
    best = 0;
    float first = row[0], second = -1e30f;
    for (int i = 1; i < n; i++) {
        if (row[i] > first) { second = first; first = row[i]; best = i; }
        else if (row[i] > second) { second = row[i]; }
    }
    gap = first - second;
}

int main(int argc, char ** argv) {
    if (argc != 4 && argc != 5) {
        fprintf(stderr, "usage: %s MODEL NGL TOKENS [LOGITS_OUT]\n", argv[0]);
        return 2;
    }
    std::vector<llama_token> tokens = parse_tokens(argv[3]);
    if (tokens.empty()) { fprintf(stderr, "no tokens\n"); return 2; }
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = atoi(argv[2]);
    llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) { fprintf(stderr, "cannot load %s\n", argv[1]); return 1; }
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = cp.n_batch = cp.n_ubatch = (uint32_t) tokens.size() + 8;
    llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) { fprintf(stderr, "cannot create a context\n"); return 1; }
    llama_batch batch = llama_batch_init((int32_t) tokens.size(), 0, 1);
    for (size_t i = 0; i < tokens.size(); i++) {
        batch.token[i] = tokens[i];
        batch.pos[i] = (llama_pos) i;
        batch.n_seq_id[i] = 1;
        batch.seq_id[i][0] = 0;
        batch.logits[i] = 1;
    }
    batch.n_tokens = (int32_t) tokens.size();
    if (llama_decode(ctx, batch) != 0) { fprintf(stderr, "llama_decode failed\n"); return 1; }
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    std::string ids = "[", gaps = "[";
    for (size_t i = 0; i < tokens.size(); i++) {
        int best; float gap;
        top2(llama_get_logits_ith(ctx, (int32_t) i), n_vocab, best, gap);
        ids += (i ? "," : "") + std::to_string(best);
        gaps += (i ? "," : "") + std::to_string(gap);
    }
    printf("{\"argmax\": %s], \"gap\": %s]}\n", ids.c_str(), gaps.c_str());
    if (argc == 5) {
        FILE * f = fopen(argv[4], "wb");
        if (!f) { fprintf(stderr, "cannot write %s\n", argv[4]); return 1; }
        for (size_t i = 0; i < tokens.size(); i++) {
            fwrite(llama_get_logits_ith(ctx, (int32_t) i), sizeof(float), (size_t) n_vocab, f);
        }
        if (fclose(f) != 0) { fprintf(stderr, "cannot write %s\n", argv[4]); return 1; }
    }
    llama_batch_free(batch);
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
