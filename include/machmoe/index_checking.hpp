// Opt-in validation of caller-supplied indices on the GPU (docs/ARCHITECTURE.md, "Index checking").
//
// By default the GPU runtime never reads caller indices back to the host (that would synchronise): a pair whose token
// or expert is out of range is skipped, and grouped rows past the expert counts' total belong to no expert. With
// index checking on, the kernels that read caller indices also record the first violation they meet (which argument,
// position, value) into a small per-device status, still without a host synchronisation and still without reading
// out of bounds. The host raises machmoe::Error for it at the next point the library controls: the next entry into
// forward, backward, backward_input, backward_weight or finish_backward_w1, or the next grouped_expert_index, on that
// device (which looks at the status of launches that have already completed, without waiting), or
// check_device_errors(), which waits for the stream first.
#pragma once

#include <cstdint>

#include "machmoe/tensor.hpp"

namespace machmoe {

/// Switches index checking on or off for the whole process. The initial state is on when the environment sets
/// MACHMOE_CHECK_INDICES=1 (read once, at the first call of any of these functions or of a layer entry point), else
/// off. Each device's status (a few bytes of device and pinned host memory) is allocated once, on the first checked
/// call on that device: make that call before capturing a CUDA graph (allocation is not allowed during a capture).
void set_index_checking(bool enabled);
bool index_checking_enabled();

/// Waits for `stream` (a cudaStream_t for `device`; nullptr: the legacy default stream), then throws machmoe::Error
/// naming the argument, the position and the value of a violation recorded on `device` by a checked launch, and
/// clears the record. Returns normally when nothing was recorded, when `device` is the CPU (CPU calls validate
/// their indices before they start), and when the device has never run a checked call.
void check_device_errors(const Device& device, void* stream = nullptr);

/// The expert of every row of pre-dispatched rows grouped by expert (the first expert_counts[0] rows belong to expert
/// 0, the next expert_counts[1] to expert 1, ...): the caller-routing input of a grouped-experts call.
/// expert_counts: (E) int32 or int64; expert_index: (rows) int32 or int64, contiguous, same device; stream as above.
/// CPU: throws machmoe::Error unless every count is >= 0 and they sum to rows, before writing anything. CUDA: never
/// synchronises, reads exactly the E counts and writes exactly the rows entries whatever the counts hold: rows past
/// the counts' total get expert E (out of range, so the layer skips them: their output is zero), negative counts give
/// unspecified experts in [0, E]; with index checking on, a negative count or a total other than rows is recorded
/// as described above.
void grouped_expert_index(const TensorView& expert_counts, const TensorView& expert_index, void* stream = nullptr);

}  // namespace machmoe
