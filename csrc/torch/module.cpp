// The Python module gqa_torch._C. Importing it registers torch.ops.gqa.* (ops.cpp); the
// functions here are the few things Python needs that are not operators.
#include <torch/extension.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "../core/errors.h"
#include "../core/fast_div.h"
#include "../core/plan.h"
#include "../cpu/lane_kernels.h"
#include "backend.h"
#include "cpu_output_cache.h"

PYBIND11_MODULE(_C, m) {
  m.doc() = "gqa_torch native extension (operators are under torch.ops.gqa)";
  m.def("built_with_cuda", &gqa::built_with_cuda, "True when this build compiled the CUDA kernels.");
  m.def("error_word", &gqa::error_word, pybind11::arg("device_index"),
        "The sticky per-device error word, as an int32 tensor aliasing its fixed address.");
  m.def("_cuda_device_support", &gqa::cuda_device_support, pybind11::arg("device_index"),
        "0 when the CUDA kernels can run on the device, 1 when it is older than compute capability 8.0, 2 when "
        "this build has no code for it (always 2 in a CPU-only build).");
  m.def("_arrival_lanes_held", &gqa::arrival_lanes_held, pybind11::arg("device_index"),
        "Tests: the lanes of decode arrival counters held on a device, one a stream that ran a decode call "
        "and one a capture of one whose graphs are not all destroyed yet (0 in a CPU-only build).");
  m.def("set_synchronous_errors", &gqa::set_synchronous_errors, pybind11::arg("enabled"));
  m.def("synchronous_errors", &gqa::synchronous_errors);
  m.def("_set_prefill_route", &gqa::set_prefill_route, pybind11::arg("route"),
        "Tests and benchmarks: pins the fp16/bf16 prefill kernel by route name, or \"auto\" (the "
        "default); an unknown name's error lists the routes.");
  m.def("_set_prefill_q_loader", &gqa::set_prefill_q_loader, pybind11::arg("loader"),
        "Tests and benchmarks: how the warp-specialised prefill stages Q, \"auto\" (TMA where it can, the "
        "default) or \"cp_async\".");
  m.def("_set_prefill_timeline", &gqa::set_prefill_timeline, pybind11::arg("records"),
        "Diagnostics: an int64 CUDA tensor [n, 8] that the warp-specialised prefill kernels stamp per query "
        "block (benchmarks/block_timeline.py), or None (the default: off). Keep the tensor alive while set.");
  m.def("_set_decode_timeline", &gqa::set_decode_timeline, pybind11::arg("records"),
        "Diagnostics: an int64 CUDA tensor [n, 16] that the tensor-core decode kernel stamps per CTA "
        "(benchmarks/decode_timeline.py), or None (the default: off). Keep the tensor alive while set. "
        "Only a build with GQA_DECODE_TIMELINE=1 in the environment stamps; others refuse a tensor.");
  m.def("_set_prefill_append", &gqa::set_prefill_append, pybind11::arg("append"),
        "Tests and benchmarks: who appends an in-place prefill's new rows (no RoPE) to the caches, \"auto\" "
        "(the attention kernel, for rows with no past, where it can: the default) or \"prep\" (always prep).");
  m.def("_set_cpu_kernels", &gqa::set_cpu_kernels, pybind11::arg("name"),
        "Tests and benchmarks: the instruction set of the CPU backend's inner loops, \"auto\" (the default: the "
        "widest this CPU has), \"baseline\", \"avx2\" or \"avx512\"; a set this CPU or build lacks runs as auto.");
  m.def(
      "_cpu_kernels", []() { return std::string(gqa::cpu::lane_kernels().name); },
      "The instruction set the CPU backend's inner loops run with now: \"baseline\", \"avx2\" or \"avx512\".");
  m.def("_set_decode_loader", &gqa::set_decode_loader, pybind11::arg("loader"),
        "Tests and benchmarks: the decode kernel's loader, \"auto\" (the default), \"cp_async\", \"tma\", "
        "\"regs_k\" or \"tma_four_warps\" (at head size 256 four warps a CTA whatever the grid; elsewhere as \"tma\").");
  m.def("_set_decode_merge", &gqa::set_decode_merge, pybind11::arg("merge"),
        "Tests and benchmarks: how the decode kernel's key-range splits are merged, \"auto\" (the default: "
        "up to 16 splits by the last split to finish, else by the merge kernel), "
        "\"kernel\" (the merge kernel always) or \"arrival\" (the last split to finish, wherever the stream "
        "has arrival counters).");
  m.def("_set_decode_schedule", &gqa::set_decode_schedule, pybind11::arg("schedule"),
        "Tests and benchmarks: the order in which the decode kernel takes the batch's rows, \"auto\" (the "
        "default: longest first where the plan says so, and a batch of equal rows in the plan's fewer splits for "
        "them), \"rows\" (row order), \"longest_first\" (decreasing visible length, wherever it can run), "
        "\"keep_splits\" (as auto, but a batch of equal rows keeps the plan's splits), \"two_per_sm\" (as auto, "
        "but two CTAs an SM where auto keeps to one) or \"one_wave\" (as auto, but a ragged batch in one wave "
        "where auto takes two).");
  m.def("_set_decode_features", &gqa::set_decode_features, pybind11::arg("features"),
        "Tests and benchmarks: which build of the tensor-core decode kernel runs, \"auto\" (the default: one "
        "compiled without RoPE, softcap, local windows, head sinks and smooth softmax for the calls that use none "
        "of them) or \"general\" (the kernel with every feature, always).");
  m.def("_set_decode_early_tiles", &gqa::set_decode_early_tiles, pybind11::arg("early"),
        "Tests and benchmarks: when the tensor-core decode kernel issues its split's first K/V tiles, \"auto\" "
        "(the default: right after it may read the caches, before the error word and the row checks) or \"off\" "
        "(after them).");
  m.def("_set_decode_l2_prefetch", &gqa::set_decode_l2_prefetch, pybind11::arg("prefetch"),
        "Tests and benchmarks: whether the tensor-core decode kernel asks L2 for its split's first keys and its "
        "query rows before it waits for the kernel before it, \"auto\" (the default: where the call's caches hold "
        "at most 8 MB of K and V), \"off\" or \"on\" (always).");
  m.def("_set_decode_l2_fetch", &gqa::set_decode_l2_fetch, pybind11::arg("fetch"),
        "Tests and benchmarks: how much L2 fetches from memory around each TMA copy of K and V in the tensor-core "
        "decode kernel (the TMA maps' L2 promotion), \"auto\" (the default: the aligned 128 bytes around each), "
        "\"sectors\" (only those read), \"128B\" or \"256B\". Its cp.async copies and its K loads into registers "
        "always ask for 128 bytes.");
  m.def("_set_decode_shares", &gqa::set_decode_shares, pybind11::arg("grid"), pybind11::arg("item_keys"),
        "Tests and benchmarks: the grid of the decode kernel's balanced partition where the plan takes it, "
        "\"auto\" (the plan's, one CTA an SM), \"items\" (one CTA a row, kv head and head chunk), "
        "\"two_per_sm\", \"cut\" (the plan's, with equal rows' items cut as any others) or \"force\" (the plan's "
        "grid for decode at head sizes 64 and 128, up to 128 rows, whether or not the plan takes it; where the "
        "partition's kernel is not built, without TMA loaders, the launch runs 16 splits an item instead), and "
        "the keys' worth each item weighs besides its keys (-1: the plan's; 512 under \"force\").");
  m.def("_decode_plan", [](int32_t batch, int32_t q_heads, int32_t kv_heads, int32_t capacity, int32_t sm_count,
                           int32_t head_dim, bool tma_kernels) {
    if (batch <= 0 || kv_heads <= 0 || q_heads <= 0 || q_heads % kv_heads != 0 || capacity <= 0 || sm_count <= 0 ||
        head_dim <= 0)
      throw std::invalid_argument("_decode_plan: expected positive sizes with kv_heads dividing q_heads");
    gqa::Params p;
    p.batch = batch;
    p.query_len = 1;
    p.q_heads = q_heads;
    p.kv_heads = kv_heads;
    p.group_size = q_heads / kv_heads;
    p.head_dim = head_dim;
    p.capacity = capacity;
    gqa::DeviceInfo device;
    device.sm_count = sm_count;
    device.decode_tma_kernels = tma_kernels;
    const gqa::Plan plan = gqa::make_plan(p, device);
    pybind11::dict out;
    out["max_splits"] = plan.max_splits;
    out["min_split_keys"] = plan.min_split_keys;
    out["longest_first"] = plan.longest_first;
    out["equal_rows_splits"] = plan.equal_rows_splits;
    out["one_cta_per_sm"] = plan.one_cta_per_sm;
    out["shares"] = plan.shares;
    out["share_item_keys"] = plan.share_item_keys;
    out["near_equal_sixteenths"] = plan.near_equal_sixteenths;
    out["ragged_two_waves"] = plan.ragged_two_waves;
    out["equal_rows_tail_splits"] = plan.equal_rows_tail_splits;
    out["equal_rows_tail_items"] = plan.equal_rows_tail_items;
    out["ragged_splits"] = plan.ragged_splits;
    return out;
  }, pybind11::arg("batch"), pybind11::arg("q_heads"), pybind11::arg("kv_heads"), pybind11::arg("capacity"),
        pybind11::arg("sm_count"), pybind11::arg("head_dim") = 128, pybind11::arg("tma_kernels") = true,
        "Tests: the decode plan's split counts, row order, CTAs an SM and waves for these shapes (core/plan.cpp), on the "
        "host (tma_kernels: DeviceInfo::decode_tma_kernels, true on an sm90 GPU with an sm90a build, where the decode "
        "kernel has its TMA loaders: four warps a CTA at head size 256, and the balanced partition at 64 and 128).");
  m.def("_set_smem_limit", &gqa::set_smem_limit_override, pybind11::arg("bytes"),
        "Tests: pretend a block may hold at most `bytes` of dynamic shared memory and leave the sm90a kernels out "
        "(0: the device's own), so that an H100 or H200 plans and runs what other GPUs do (kernels/launch.h).");
  m.def("_set_decode_split_override", &gqa::set_decode_split_override, pybind11::arg("max_splits"),
        pybind11::arg("min_split_keys"), "Benchmarks only: decode split count and smallest split (0: the plan's).");
  m.def("_fast_divide", [](const std::vector<int32_t>& numerators, int32_t divisor) {
    if (divisor <= 0) throw std::invalid_argument("_fast_divide: the divisor must be positive");
    const gqa::FastDivisor f = gqa::make_fast_divisor(divisor);
    std::vector<int32_t> quotients;
    quotients.reserve(numerators.size());
    for (int32_t n : numerators) {
      if (n < 0) throw std::invalid_argument("_fast_divide: numerators must be non-negative");
      quotients.push_back(f.divide(n));
    }
    return quotients;
  }, pybind11::arg("numerators"), pybind11::arg("divisor"),
        "Tests: the prefill kernels' division by a launch-invariant divisor (core/fast_div.h), on the host.");
  m.def("_cpu_output_cache_info", []() {
    const gqa::CpuOutputCacheInfo info = gqa::cpu_output_cache_info();
    pybind11::dict out;
    out["limit_bytes"] = info.limit_bytes;
    out["cached_bytes"] = info.cached_bytes;
    out["cached_blocks"] = info.cached_blocks;
    out["hits"] = info.hits;
    out["misses"] = info.misses;
    return out;
  }, "The recycling cache of the CPU ops' large outputs (csrc/torch/cpu_output_cache.h): its limit, what it "
     "holds, and how many large outputs it served (hits) or allocated fresh (misses).");
  m.def("_release_cpu_output_cache", &gqa::release_cpu_output_cache, "Frees every block the cache holds.");
  m.def("_set_cpu_output_cache_limit", [](int64_t bytes) {
    if (bytes < 0) throw std::invalid_argument("the CPU output cache limit must be 0 or more bytes");
    gqa::set_cpu_output_cache_limit(size_t(bytes));
  }, pybind11::arg("bytes"), "The most the cache may hold (0 disables it and frees what it holds).");
  m.def("error_flag_messages", []() {
    std::vector<std::string> messages;
    for (int bit = 0; bit < gqa::kNumErrorFlags; ++bit) messages.emplace_back(gqa::error_flag_message(bit));
    return messages;
  }, "The wording of each error flag, in bit order.");
}
