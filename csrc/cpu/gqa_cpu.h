// The CPU backend: every SPEC feature, parallel over (row, kv head), fp32 accumulation, an
// online softmax over key tiles. Pointers in `params` are host pointers.
#pragma once

#include <cstdint>
#include <string>

#include "../core/params.h"

namespace gqa {
namespace cpu {

// Checks seqlens_k and position_ids for every row before anything is written.
// Returns an empty string when valid, otherwise a message naming the first bad row and its
// bound; `flags` (may be null) receives the SPEC §4 flags of all rows (positions are checked
// only for rows whose bounds hold).
std::string validate_rows(const Params& params, uint32_t* flags);

// Runs the call: functional past copy / zero fill, RoPE, append, attention, output.
// Assumes validate_rows returned "".
void run(const Params& params);

}  // namespace cpu
}  // namespace gqa
