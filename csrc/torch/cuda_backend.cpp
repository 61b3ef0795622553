#include "backend.h"

#include <atomic>
#include <iterator>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "../core/errors.h"
#include "../core/plan.h"
#include "../cpu/lane_kernels.h"

#ifdef GQA_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include "../kernels/launch.h"
#include "../kernels/prefill_mma.h"
#endif

namespace gqa {
namespace {
std::atomic<bool> g_synchronous_errors{false};
std::atomic<int32_t> g_split_override{0};
std::atomic<int32_t> g_min_split_keys_override{0};
// set_decode_shares("force", ...): the balanced partition for decode at head sizes 64 and 128, 1-128
// rows, with this item weight (without the TMA loaders its kernel is built on, the launch runs 16
// splits an item instead: the plan's choice before stop 81); -1: off.
std::atomic<int32_t> g_forced_share_item_keys{-1};
}

namespace {
// The index of `name` in `names` (a switch's accepted values); otherwise a ValueError that
// names the switch and lists them.
template <size_t N>
int switch_code(const char* const (&names)[N], const std::string& name, const char* what) {
  std::string listed;
  for (size_t i = 0; i < N; ++i) {
    if (name == names[i]) return static_cast<int>(i);
    listed += (i ? ", " : "") + std::string(names[i]);
  }
  TORCH_CHECK_VALUE(false, "gqa: ", what, ": expected one of ", listed, ", got \"", name, "\"");
  return -1;  // not reached
}

// Sets one of the kernels' switches to the index of `name` in `names` through `set`, which is
// null in a CPU-only build (the name is still checked there).
template <size_t N>
void set_switch(const char* const (&names)[N], const std::string& name, const char* what, void (*set)(int)) {
  const int code = switch_code(names, name, what);
  if (set != nullptr) set(code);
}
}  // namespace

#ifdef GQA_WITH_CUDA
#define GQA_CUDA_SWITCH(setter) (&cuda::setter)
#else
#define GQA_CUDA_SWITCH(setter) nullptr
#endif

void set_prefill_route(const std::string& route) {
  // The index is the kernel's route code (prefill_mma.cu, launch_default).
  static const char* const kRoutes[] = {"auto",      "mma",        "wgmma",           "wgmma_ws", "wgmma_ws_cpasync",
                                        "wgmma_ws_persistent", "wgmma_ws3", "wgmma_ws_kv", "wgmma_ws_kv_pipe",
                                        "wgmma_ws_bn80", "wgmma_ws_kv_pipe_pp", "wgmma_ws_kv_pipe3", "x_head_groups", "x_group_rounds",
                                        "x_plain_pp", "x_one_step", "x_narrow_o", "x_q_first",
                                        "x_static_walk"};
  set_switch(kRoutes, route, "prefill route", GQA_CUDA_SWITCH(set_prefill_route));
}

void set_prefill_q_loader(const std::string& loader) {
  // The index is the kernel's Q loader code (kernels/prefill_mma.h).
  static const char* const kLoaders[] = {"auto", "cp_async"};
  set_switch(kLoaders, loader, "prefill Q loader", GQA_CUDA_SWITCH(set_prefill_q_loader));
}

namespace {

// A timeline's records tensor, checked (int64, CUDA, contiguous, [n, width]), handed to
// `setter` (the kernels' own, which takes nullptr and 0 for none; null in a CPU-only build).
void set_timeline(const std::optional<at::Tensor>& records, const char* name, int64_t width,
                  void (*setter)(unsigned long long*, int)) {
  if (!records.has_value()) {
    if (setter != nullptr) setter(nullptr, 0);
    return;
  }
  const at::Tensor& t = *records;
  TORCH_CHECK_VALUE(t.is_cuda() && t.scalar_type() == at::kLong && t.is_contiguous() && t.dim() == 2 &&
                        t.size(1) == width,
                    "gqa: ", name, ": expected a contiguous int64 CUDA tensor of shape [records, ", width, "], got ",
                    t.scalar_type(), " ", t.sizes(), t.is_cuda() ? "" : " on the CPU");
  TORCH_CHECK_VALUE(t.size(0) <= INT32_MAX, "gqa: ", name, ": at most 2^31 - 1 records, got ", t.size(0));
  if (setter != nullptr)
    setter(reinterpret_cast<unsigned long long*>(t.data_ptr<int64_t>()), static_cast<int>(t.size(0)));
}

}  // namespace

void set_prefill_timeline(const std::optional<at::Tensor>& records) {
  set_timeline(records, "prefill timeline", 8, GQA_CUDA_SWITCH(set_prefill_timeline));
}

void set_decode_timeline(const std::optional<at::Tensor>& records) {
  void (*setter)(unsigned long long*, int) = GQA_CUDA_SWITCH(set_decode_timeline);
#ifdef GQA_WITH_CUDA
  // The stamps cost the kernel's short path even when off, so the default build has none
  // (decode_mma.cuh): there a buffer is refused, after the same checks as in every build.
  const bool refused = records.has_value() && !cuda::decode_timeline_built();
  if (refused) setter = nullptr;
#else
  const bool refused = false;
#endif
  set_timeline(records, "decode timeline", 16, setter);  // kDecodeTimelineFields
  TORCH_CHECK_VALUE(!refused, "gqa: decode timeline: this build has no decode stamps; rebuild with "
                              "GQA_DECODE_TIMELINE=1 in the environment (benchmarks/decode_timeline.py)");
}

void set_prefill_append(const std::string& append) {
  // The index is the kernel's append code (kernels/prefill_mma.h).
  static const char* const kAppends[] = {"auto", "prep"};
  set_switch(kAppends, append, "prefill append", GQA_CUDA_SWITCH(set_prefill_append));
}

void set_cpu_kernels(const std::string& name) {
  // (not a CUDA switch, but the same lookup and message)
  set_switch(cpu::kLaneKernelNames, name, "CPU kernels", &cpu::set_lane_kernels);
}

void set_decode_loader(const std::string& loader) {
  // The index is set_decode_loader's value (kernels/launch.h), not the kernel's loader code.
  static const char* const kLoaders[] = {"auto",           "cp_async",         "tma",
                                         "regs_k",         "tma_four_warps",   "cp_async_shallow",
                                         "cp_async_one_ahead", "tma_one_ahead", "tma_shallow",
                                         "tma_wide"};
#ifdef GQA_WITH_CUDA
  static_assert(std::size(kLoaders) == cuda::kDecodeLoaderPins, "a name for each of launch.h's DecodeLoaderPin");
#endif
  set_switch(kLoaders, loader, "decode loader", GQA_CUDA_SWITCH(set_decode_loader));
}

void set_decode_merge(const std::string& merge) {
  // The index is the merge code of kernels/launch.h.
  static const char* const kMerges[] = {"auto", "kernel", "arrival"};
  set_switch(kMerges, merge, "decode merge", GQA_CUDA_SWITCH(set_decode_merge));
}

void set_decode_schedule(const std::string& schedule) {
  // The index is the schedule code of kernels/launch.h.
  static const char* const kSchedules[] = {"auto", "rows", "longest_first", "keep_splits", "two_per_sm", "one_wave"};
  set_switch(kSchedules, schedule, "decode schedule", GQA_CUDA_SWITCH(set_decode_schedule));
}

void set_decode_features(const std::string& features) {
  // The index is the features code of kernels/launch.h.
  static const char* const kFeatures[] = {"auto", "general"};
  set_switch(kFeatures, features, "decode features", GQA_CUDA_SWITCH(set_decode_features));
}

void set_decode_early_tiles(const std::string& early) {
  // The index is the early-tiles code of kernels/launch.h.
  static const char* const kEarly[] = {"auto", "off"};
  set_switch(kEarly, early, "decode early tiles", GQA_CUDA_SWITCH(set_decode_early_tiles));
}

void set_decode_l2_prefetch(const std::string& prefetch) {
  // The index is the L2 prefetch code of kernels/launch.h.
  static const char* const kPrefetch[] = {"auto", "off", "on"};
  set_switch(kPrefetch, prefetch, "decode L2 prefetch", GQA_CUDA_SWITCH(set_decode_l2_prefetch));
}

void set_decode_l2_fetch(const std::string& fetch) {
  // The index is the L2 fetch code of kernels/launch.h.
  static const char* const kFetch[] = {"auto", "sectors", "128B", "256B"};
  set_switch(kFetch, fetch, "decode L2 fetch", GQA_CUDA_SWITCH(set_decode_l2_fetch));
}

void set_decode_shares(const std::string& grid, int64_t item_keys) {
  // The index is the share grid code of kernels/launch.h.
  // "force" (not a launch code): the plan's grid, taken for head sizes 64 and 128 (run_cuda).
  static const char* const kGrids[] = {"auto", "items", "two_per_sm", "cut", "force"};
  TORCH_CHECK_VALUE(item_keys >= -1 && item_keys <= (1 << 20), "gqa: item_keys: expected -1..1048576, got ",
                    item_keys);
  int code = switch_code(kGrids, grid, "decode share grid");
  const bool force = grid == "force";
  g_forced_share_item_keys = force ? static_cast<int32_t>(item_keys >= 0 ? item_keys : kShareItemKeys) : -1;
  if (force) code = 0;
#ifdef GQA_WITH_CUDA
  cuda::set_decode_shares(code, static_cast<int>(item_keys));
#else
  (void)code;
#endif
}

void set_smem_limit_override(int64_t bytes) {
  TORCH_CHECK_VALUE(bytes >= 0 && bytes <= (1 << 30), "gqa: shared-memory budget: expected 0..2^30 bytes, got ", bytes);
#ifdef GQA_WITH_CUDA
  cuda::set_smem_limit_override(static_cast<int>(bytes));
#endif
}

void set_decode_split_override(int64_t max_splits, int64_t min_split_keys) {
  TORCH_CHECK_VALUE(max_splits >= 0 && max_splits <= 128, "gqa: max_splits: expected 0..128, got ", max_splits);
  TORCH_CHECK_VALUE(min_split_keys >= 0 && min_split_keys <= (1 << 20),
                    "gqa: min_split_keys: expected 0..1048576, got ", min_split_keys);
  g_split_override = static_cast<int32_t>(max_splits);
  g_min_split_keys_override = static_cast<int32_t>(min_split_keys);
}

void set_synchronous_errors(bool enabled) { g_synchronous_errors = enabled; }
bool synchronous_errors() { return g_synchronous_errors; }

#ifndef GQA_WITH_CUDA

bool built_with_cuda() { return false; }

void run_cuda(Params&, const at::Tensor&, bool) {
  TORCH_CHECK(false,
              "gqa: this build of gqa_torch has no CUDA kernels (it was built CPU-only, see "
              "gqa_torch.build_info()); rebuild with a CUDA-enabled torch and a matching nvcc, or call "
              "the op on CPU tensors");
}

at::Tensor error_word(int64_t) {
  TORCH_CHECK(false, "gqa: the error word exists only in a CUDA build (gqa_torch.build_info())");
}

int64_t arrival_lanes_held(int64_t) { return 0; }

int64_t cuda_device_support(int64_t) { return 2; }

#else

namespace {

constexpr int kMaxDevices = 64;
// The decode kernel's arrival counters (decode_arrival.cuh) sit after the error word in the same
// allocation: kArrivalLanes lanes of kArrivalSlots counters. Each stream takes a free lane the
// first time it runs a call, and keeps it, and so does each graph capture (by its capture id):
// two streams never share counters, and neither do a graph and the eager calls on the stream it
// was captured on, nor two graphs. (Replaying one graph on two streams at once shares its
// counters, as it shares its workspace.) A capture's lane is given back when the last graph
// made from it is destroyed (a CUDA user object the graph holds: release_capture_lane), so
// that a process capturing graph after graph does not run out of lanes. A call when every lane
// is held, or with more (row, kv head, head chunk) slots than a lane holds, merges its splits
// with the merge kernel instead (slower: at B = 8 with 1,024 keys 17.5 µs against 12.3 on an
// H200). The first call that finds every lane held warns, and so does the first after a lane
// came back and every lane is held again.
constexpr int kArrivalLanes = 256;
constexpr int kArrivalSlots = 2048;
constexpr size_t kWordBytes = 256;
std::mutex g_word_mutex;
uint32_t* g_words[kMaxDevices] = {};
struct LaneOwner {
  cudaStream_t stream;
  unsigned long long capture_id;  // 0: eager calls on the stream
  bool free;                      // a capture's lane, given back with its last graph
};
std::vector<LaneOwner> g_lane_owners[kMaxDevices];
// Set by release_capture_lane, which runs on a CUDA thread and must not block, so it takes no
// lock; arrival_lane frees the lanes it marks (under g_word_mutex).
std::atomic<bool> g_lane_released[kMaxDevices][kArrivalLanes];
// Whether the "every lane is held" warning was given since a lane last came back (under
// g_word_mutex).
bool g_all_lanes_held_warned[kMaxDevices] = {};

void check_cuda(cudaError_t status, const char* what) {
  TORCH_CHECK(status == cudaSuccess, "gqa: ", what, " failed: ", cudaGetErrorString(status));
}

bool stream_is_capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  check_cuda(cudaStreamIsCapturing(stream, &status), "cudaStreamIsCapturing");
  return status != cudaStreamCaptureStatusNone;
}

// The word lives outside the caching allocator so that its address never changes: graphs
// captured now keep reading and writing the same word on every replay.
uint32_t* device_word(int device, cudaStream_t stream) {
  TORCH_CHECK(device >= 0 && device < kMaxDevices, "gqa: device index ", device, " out of range");
  std::lock_guard<std::mutex> lock(g_word_mutex);
  if (g_words[device] == nullptr) {
    TORCH_CHECK(!stream_is_capturing(stream),
                "gqa: the first gqa call on cuda:", device,
                " happened inside CUDA-graph capture; run one call (or gqa_torch.check_errors()) on this "
                "device before capturing, as the usual warm-up does");
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
    void* ptr = nullptr;
    const size_t bytes = kWordBytes + sizeof(uint32_t) * kArrivalLanes * kArrivalSlots;
    check_cuda(cudaMalloc(&ptr, bytes), "cudaMalloc(error word)");
    check_cuda(cudaMemset(ptr, 0, bytes), "cudaMemset(error word)");
    check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize(error word)");
    g_words[device] = static_cast<uint32_t*>(ptr);
  }
  return g_words[device];
}

// The destructor of a capture lane's user object (tie_lane_to_graph): the last graph holding
// the capture is gone, and CUDA runs this only once no launch of it is pending, so the lane's
// counters are zero again (every call leaves them so).
void release_capture_lane(void* code) {
  const uintptr_t c = reinterpret_cast<uintptr_t>(code) - 1;
  g_lane_released[c / kArrivalLanes][c % kArrivalLanes].store(true, std::memory_order_release);
}

// Ties `lane` of `device` to the graph under capture: the graph holds a user object whose
// destructor gives the lane back. Where that fails, the lane stays held for good, as every
// capture's lane did before: a lost lane, never one shared while a graph may still use it.
void tie_lane_to_graph(int device, int lane, cudaGraph_t graph) {
  if (graph == nullptr) return;
  void* const code = reinterpret_cast<void*>(static_cast<uintptr_t>(device) * kArrivalLanes + lane + 1);
  cudaUserObject_t object = nullptr;
  if (cudaUserObjectCreate(&object, code, release_capture_lane, 1, cudaUserObjectNoDestructorSync) != cudaSuccess) {
    (void)cudaGetLastError();
    return;
  }
  // With cudaGraphUserObjectMove the graph takes over this thread's reference. On failure the
  // object keeps it (releasing it would run the destructor and free a lane the graph uses).
  if (cudaGraphRetainUserObject(graph, object, 1, cudaGraphUserObjectMove) != cudaSuccess) (void)cudaGetLastError();
}

// Frees the lanes whose graphs are gone (g_lane_released). Under g_word_mutex.
void reclaim_released_lanes(int device) {
  std::vector<LaneOwner>& owners = g_lane_owners[device];
  for (size_t lane = 0; lane < owners.size(); ++lane) {
    if (g_lane_released[device][lane].exchange(false, std::memory_order_acquire)) {
      owners[lane].free = true;
      g_all_lanes_held_warned[device] = false;
    }
  }
}

// The counters of `lane` on `device`, in the allocation that device_word made.
uint32_t* lane_counters(int device, size_t lane) {
  return g_words[device] + kWordBytes / sizeof(uint32_t) + lane * kArrivalSlots;
}

// The lane of arrival counters on `device` (whose word device_word allocated) of this stream,
// or of the capture under way on it; null when every lane is held.
uint32_t* arrival_lane(int device, cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  unsigned long long capture_id = 0;
  cudaGraph_t graph = nullptr;
  check_cuda(cudaStreamGetCaptureInfo(stream, &status, &capture_id, &graph), "cudaStreamGetCaptureInfo");
  if (status != cudaStreamCaptureStatusActive) {
    capture_id = 0;
    graph = nullptr;
  }
  size_t lane = 0;
  {
    std::lock_guard<std::mutex> lock(g_word_mutex);
    std::vector<LaneOwner>& owners = g_lane_owners[device];
    const auto held_by_caller = [&](const LaneOwner& o) {
      return !o.free && o.stream == stream && o.capture_id == capture_id;
    };
    while (lane < owners.size() && !held_by_caller(owners[lane])) ++lane;
    if (lane < owners.size()) return lane_counters(device, lane);
    reclaim_released_lanes(device);
    lane = 0;
    while (lane < owners.size() && !owners[lane].free) ++lane;
    if (lane == owners.size()) {
      if (lane == kArrivalLanes) {
        if (g_all_lanes_held_warned[device]) return nullptr;
        g_all_lanes_held_warned[device] = true;
        TORCH_WARN("gqa: all ", kArrivalLanes, " lanes of decode arrival counters on cuda:", device,
                   " are held (one a stream that ran a decode call, one a live CUDA graph that captured one), so "
                   "decode calls without one merge their key-range splits in a separate, slower kernel. Destroying "
                   "CUDA graphs that are no longer replayed gives their lanes back.");
        return nullptr;
      }
      owners.push_back(LaneOwner{});
    }
    owners[lane] = LaneOwner{stream, capture_id, false};
  }
  if (capture_id != 0) tie_lane_to_graph(device, static_cast<int>(lane), graph);
  return lane_counters(device, lane);
}

// What cuda::current_device_support said of each device, plus one (0: not asked yet).
std::atomic<int> g_device_support[kMaxDevices];

// Whether the kernels can run on `device`, asked of the runtime once per device. Not inside
// capture, which the runtime's question could disturb: kDeviceSupported then, and the device
// stays unasked (its first call cannot be captured anyway, device_word).
cuda::DeviceSupport device_support(int device) {
  const int known = g_device_support[device].load(std::memory_order_relaxed);
  if (known != 0) return static_cast<cuda::DeviceSupport>(known - 1);
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  if (stream_is_capturing(at::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream()))
    return cuda::kDeviceSupported;
  const cuda::DeviceSupport support = cuda::current_device_support();
  g_device_support[device].store(static_cast<int>(support) + 1, std::memory_order_relaxed);
  return support;
}

// Throws if the kernels cannot run on `device`, with a message that says what to do (not a
// launch's bare "no kernel image is available").
void check_device_supported(int device) {
  const cuda::DeviceSupport support = device_support(device);
  if (support == cuda::kDeviceSupported) return;
  const cudaDeviceProp* prop = at::cuda::getDeviceProperties(device);
  const std::string cc = std::to_string(prop->major) + "." + std::to_string(prop->minor);
  // (An sm90 GPU wants its arch-specific code too, where the fastest kernels are.)
  const std::string arch = prop->major == 9 && prop->minor == 0 ? "9.0a" : cc;
  TORCH_CHECK(support != cuda::kDeviceTooOld, "gqa: cuda:", device, " (", prop->name, ", compute capability ", cc,
              ") is older than gqa_torch's CUDA kernels support: they need compute capability 8.0 or newer "
              "(bf16 tensor-core mma and cp.async). Call the op on CPU tensors on this machine.");
  TORCH_CHECK(false, "gqa: this build of gqa_torch has no CUDA code for cuda:", device, " (", prop->name,
              ", compute capability ", cc, "); gqa_torch.build_info()['cuda_archs'] lists the architectures it "
              "was built for. Rebuild it for this GPU: on a machine with the GPU the build targets it by default, or "
              "set TORCH_CUDA_ARCH_LIST=\"", arch, "\" (README, Install).");
}

DeviceInfo device_info(int device) {
  const cudaDeviceProp* prop = at::cuda::getDeviceProperties(device);
  DeviceInfo info;
  info.sm_count = prop->multiProcessorCount;
  info.sm_major = prop->major;
  info.decode_tma_kernels = gqa::cuda::decode_tma_kernels(prop->major);
  return info;
}

std::string describe_flags(uint32_t flags) {
  std::string text;
  for (int bit = 0; bit < kNumErrorFlags; ++bit) {
    if (flags & (1u << bit)) {
      if (!text.empty()) text += "; ";
      text += error_flag_message(bit);
    }
  }
  return text.empty() ? std::string("unknown flags") : text;
}

}  // namespace

bool built_with_cuda() { return true; }

int64_t arrival_lanes_held(int64_t device_index) {
  TORCH_CHECK_VALUE(device_index >= 0 && device_index < kMaxDevices, "gqa: device index ", device_index,
                    " out of range");
  std::lock_guard<std::mutex> lock(g_word_mutex);
  const int device = static_cast<int>(device_index);
  reclaim_released_lanes(device);
  int64_t held = 0;
  for (const LaneOwner& o : g_lane_owners[device]) held += o.free ? 0 : 1;
  return held;
}

int64_t cuda_device_support(int64_t device_index) {
  TORCH_CHECK_VALUE(device_index >= 0 && device_index < kMaxDevices && device_index < c10::cuda::device_count(),
                    "gqa: device index ", device_index, " out of range");
  return device_support(static_cast<int>(device_index));
}

at::Tensor error_word(int64_t device_index) {
  const auto stream = at::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device_index));
  uint32_t* word = device_word(static_cast<int>(device_index), stream.stream());
  return at::from_blob(word, {1}, at::TensorOptions().dtype(at::kInt).device(at::kCUDA, device_index));
}

void run_cuda(Params& p, const at::Tensor& query, bool synchronous_check) {
  TORCH_CHECK_VALUE(p.head_dim % 2 == 0, "gqa: query: expected an even head_size on CUDA, got ", p.head_dim);
  const int device = query.get_device();
  c10::cuda::CUDAGuard guard(query.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream(device).stream();
  p.error_word = device_word(device, stream);  // (checks the index)
  check_device_supported(device);
  if (p.query_len == 1) {
    p.arrival_counters = arrival_lane(device, stream);
    p.arrival_slots = p.arrival_counters != nullptr ? kArrivalSlots : 0;
  }

  const DeviceInfo info = device_info(device);
  Plan plan = make_plan(p, info);
  if (plan.route == Route::kDecode && (g_split_override > 0 || g_min_split_keys_override > 0)) {
    if (plan.ragged_splits > 0) plan.max_splits = plan.ragged_splits;  // (no tail splits: the plan's own)
    if (g_split_override > 0) plan.max_splits = g_split_override;
    if (g_min_split_keys_override > 0) plan.min_split_keys = g_min_split_keys_override;
    clear_split_grid_rules(plan);  // (a batch of equal rows takes the pinned count too)
    plan.shares = 0;
    layout_workspace(plan, p);
  }
  const int32_t forced_item_keys = g_forced_share_item_keys;
  if (plan.route == Route::kDecode && forced_item_keys >= 0 && (p.head_dim == 64 || p.head_dim == 128) &&
      p.batch <= 128) {
    take_shares(plan, info.sm_count, forced_item_keys);
    layout_workspace(plan, p);
  }
  // One allocation from PyTorch's caching allocator (stream-ordered and capture-safe), when
  // the plan needs scratch at all.
  at::Tensor workspace;
  void* scratch = nullptr;
  if (plan.workspace.total_bytes > 0) {
    workspace = at::empty({static_cast<int64_t>(plan.workspace.total_bytes)}, query.options().dtype(at::kByte));
    scratch = workspace.data_ptr();
  }
  cuda::launch(p, plan, scratch, stream);

  if ((synchronous_check || g_synchronous_errors) && !stream_is_capturing(stream)) {
    uint32_t flags = 0;
    check_cuda(cudaMemcpyAsync(&flags, p.error_word, sizeof(flags), cudaMemcpyDeviceToHost, stream),
               "reading the error word");
    check_cuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
    if (flags != 0) {
      check_cuda(cudaMemsetAsync(p.error_word, 0, sizeof(uint32_t), stream), "clearing the error word");
      TORCH_CHECK_VALUE(false, "[gqa-error-flags=", flags, "] gqa: bad seqlens_k/position_ids on cuda:", device,
                        ": ", describe_flags(flags),
                        ". The violating rows wrote nothing and their outputs are NaN; the flags are now cleared");
    }
  }
}

#endif

}  // namespace gqa
