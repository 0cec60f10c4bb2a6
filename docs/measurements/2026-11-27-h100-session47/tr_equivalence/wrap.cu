// One-off (not a repo test): exposes one build of token_rounding_kernels.cu under C names, NAME_fwd / NAME_bwd.
#include TR_SRC
#define CAT2(a, b) a##b
#define CAT(a, b) CAT2(a, b)
extern "C" void CAT(TR_NAME, _fwd)(int dt, long T, long E, long K, long M, long P_max, int variant, int rule,
                                   const void* logits, long ld, void* keys, void* kbe, void* thr, void* counters,
                                   unsigned long counters_bytes, void* counts, void* offsets, void* tiles,
                                   void* scatter, void* inverse, void* gather, void* token_offsets, void* scores,
                                   void* bounds, void* row_scores) {
  using namespace machmoe;
  gpu::TokenRoundingArgs a;
  a.dt = static_cast<DType>(dt);
  a.T = T, a.E = E, a.K = K, a.tile_m = M, a.P_max = P_max;
  a.variant = static_cast<ScoreVariant>(variant), a.rule = static_cast<RoundingRule>(rule);
  a.logits = logits, a.ld_logits = ld;
  a.keys = static_cast<std::uint32_t*>(keys), a.keys_by_expert = static_cast<std::uint32_t*>(kbe);
  a.thresholds = static_cast<std::uint32_t*>(thr), a.counters = counters, a.counters_bytes = counters_bytes;
  a.expert_counts = static_cast<std::int32_t*>(counts), a.expert_offsets = static_cast<std::int32_t*>(offsets);
  a.expert_tiles = static_cast<std::int32_t*>(tiles), a.scatter = static_cast<std::int32_t*>(scatter);
  a.inverse = static_cast<std::int32_t*>(inverse), a.gather = static_cast<std::int32_t*>(gather);
  a.token_offsets = static_cast<std::int32_t*>(token_offsets), a.scores = static_cast<float*>(scores);
#ifdef TR_BOUNDS
  a.bounds = static_cast<std::uint32_t*>(bounds);
#else
  (void)bounds;
#endif
#ifdef TR_ROWS
  a.row_scores = static_cast<float*>(row_scores);
#else
  (void)row_scores;
#endif
  gpu::launch_token_rounding(a, nullptr);
}
extern "C" void CAT(TR_NAME, _bwd)(int dt, int variant, const void* logits, long T, long E, long K, const float* ds,
                                   const int* inverse, const int* offsets, const int* token_offsets,
                                   void* dlogits) {
  using namespace machmoe;
  gpu::launch_token_rounding_backward(static_cast<DType>(dt), static_cast<ScoreVariant>(variant), logits, T, E, K,
                                      ds, inverse, offsets, token_offsets, nullptr, 0, dlogits, nullptr);
}
