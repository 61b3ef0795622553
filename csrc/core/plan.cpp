#include "plan.h"

namespace gqa {

size_t align_workspace(size_t bytes) { return (bytes + 255) / 256 * 256; }

Plan make_plan(const Params& p, const DeviceInfo& device) {
  Plan plan;
  plan.route = p.query_len == 1 ? Route::kDecode : Route::kPrefill;

  if (plan.route == Route::kDecode) {
    // One CTA per (row, kv head, split). Take as many splits as give one CTA per SM (floor,
    // not ceil: a second, nearly empty wave of full-length CTAs would double the time), so that
    // B=1 still fills every SM. The split sweep on an H200 (benchmarks/results/
    // sweep_decode_splits.md) found one CTA per SM as fast as two or faster on the rows where
    // the two differ (B8 L1024: 19.0 against 20.1 us; B1 L32768: 43.4 against 44.7), and fewer
    // splits mean less merge work. While every CTA of the call is resident at once (the decode
    // kernel fits two an SM), the longest row sets the time, so also take enough splits that a
    // full-capacity row splits into chunks of <= 4096 keys: a ragged batch is then spread
    // evenly over the SMs. With more CTAs than that, the SMs that finish short rows take the
    // next ones (B64 L8192, all rows full: one split 516 us, two 536).
    const int64_t base_ctas = static_cast<int64_t>(p.batch) * p.kv_heads;
    const int64_t sms = device.sm_count > 0 ? device.sm_count : 1;
    int64_t splits = sms / (base_ctas > 0 ? base_ctas : 1);
    // At head sizes 64 and 128, a power of two where that idles at most 1/16 of the SMs more:
    // 66 splits a kv head become 64 at B = 1 with 2 kv heads, 33 become 32 with 4. At long rows
    // each split keeps its number of tiles (497 keys and 512 are both 8 tiles of 64), and the
    // grid has fewer CTAs and partials; why that pays by more than the 3% of the SMs it idles
    // was not profiled. H200, stop 53, interleaved, two runs each, us, the build before / this
    // rule: 14/2/64 L32768 9.33, 9.35 / 9.10, 9.12 (1.294-1.298x SDPA cuDNN); 28/4/128 L8192
    // 9.79-9.82 / 9.69, L16384 13.68-13.70 / 13.49-13.51, L32768 22.50-22.51 / 21.99; B2
    // 14/2/128 L32768 22.43-22.51 / 22.01-22.04; 16/4/128 L8192 9.43-9.44 / 9.32-9.33; level at
    // 14/2/64 L16384 (6.98 / 6.95-6.97). Not at head size 256, where 32 splits ran slower under
    // a pin (8/4/256 L8192 17.48-17.51 against 17.16-17.26). Nor may a row take fewer splits
    // than the grid has instead: 32 splits of 28/4/128 L8192 in the grid of 33, the other CTA
    // of each kv head leaving, ran 10.32 (9.69 in a grid of 32), and 64 of 14/2/64 L32768 in
    // the grid of 66 ran 10.56-10.64 (NOTES.md, forty-fifth round): with leaving CTAs between
    // the working ones, the SMs took two working CTAs on 10-12 of them (forty-sixth round).
    if (p.head_dim == 64 || p.head_dim == 128) {
      int64_t power_of_two = 1;
      while (2 * power_of_two <= splits) power_of_two *= 2;
      if (16 * power_of_two >= 15 * splits) splits = power_of_two;
    }
    const int64_t by_chunk = (static_cast<int64_t>(p.capacity) + 4095) / 4096;
    if (base_ctas < 2 * sms && splits < by_chunk) splits = by_chunk;
    // Two CTAs an SM instead, where each split still holds 2,048 keys of capacity or more: the
    // decode kernel then loads K straight into registers (launch_decode_loader), which streams
    // faster than one CTA an SM staging K and V through shared memory. H200, twenty-fifth
    // round: B8 L8192, 4 splits 68.7 us against 2 splits 71.3.
    // At head size 256 a CTA of two warps (decode_mma.cuh) paid two an SM from splits of 256
    // keys (H200, thirtieth round: B8 32/8/256 L1024 in 4 splits 31.1 us against 34.8 in 2).
    // Where the kernel has four warps a CTA there (DeviceInfo::decode_tma_kernels), one wave
    // of them at one CTA an SM is faster (thirty-ninth round, interleaved, us, four warps /
    // two warps two CTAs an SM: B8 L1024 in 2 splits 23.5 / 28.7 in 4, B8 L8192 128.1 / 137.9,
    // B4 L8192 in 4 splits 69.2 / 79.9 in 8, B2 L8192 in 8 40.3 / 50.8 in 16), so none there.
    const int64_t hchunks = decode_head_chunks(p.group_size);  // CTAs a kv head
    const int64_t slots = base_ctas * hchunks;                  // CTAs a split: (row, kv head, head chunk)
    const int64_t two_per_sm = 2 * sms / (slots > 0 ? slots : 1);
    const bool four_warps = p.head_dim == 256 && device.decode_tma_kernels;
    const int64_t two_per_sm_min_keys = p.head_dim == 256 ? 256 : 2048;
    if (!four_warps && two_per_sm > splits && p.capacity / two_per_sm >= two_per_sm_min_keys) splits = two_per_sm;
    if (splits < 1) splits = 1;
    if (splits > 128) splits = 128;  // the merge kernel combines at most 128 splits
    // Never more splits than the capacity can feed. A split never takes fewer than
    // min_split_keys keys (one 64-key tile), so short rows use fewer splits (chosen on the
    // device from each row's visible length).
    plan.min_split_keys = 64;
    const int64_t by_capacity = (static_cast<int64_t>(p.capacity) + plan.min_split_keys - 1) / plan.min_split_keys;
    if (splits > by_capacity) splits = by_capacity < 1 ? 1 : by_capacity;
    plan.max_splits = static_cast<int32_t>(splits);
    // With more CTAs than SMs, the SMs take the CTAs in launch order. In row order, a long
    // row's CTAs dispatched last leave them streaming after the others have finished, so the
    // device takes the rows longest first: the short rows' CTAs fill in behind. On an H200
    // (twenty-second round) that brought ragged batches to the time of a batch of equal rows
    // holding the same keys: B8 capacity 32768, 136.6 to 125.4 us (equal rows: 124.1); B32
    // capacity 8192, 172.8 to 161.9 (162.9). Not where the splits hold under 2,048 keys of
    // capacity: a late short CTA costs little there, and the ranking did (B64 L1024, all rows
    // full: 74.6 us against 73.3).
    plan.longest_first = p.batch >= 2 && slots * splits > sms && p.capacity / splits >= 2048;
    // A batch of equal rows needs no splits to spread its long rows: one wave does. Where one
    // CTA a (row, kv head, head chunk) fills 90% of the SMs or more, one split (no merge at all);
    // else as many as fill two CTAs an SM, where the chunks of 4,096 keys took more (H200,
    // split pins, interleaved: B16 64/8 L8192 in 1 split 124.1-124.8 us against 2 in 128.0-128.3,
    // twenty-ninth and thirty-first rounds; B8 32/8 L32768 in 4 splits 245.1 against 8 in 246.5,
    // twenty-ninth round).
    int64_t equal_splits = splits;
    if (slots <= sms && 10 * slots >= 9 * sms) {
      equal_splits = 1;
    } else if (two_per_sm >= 1 && two_per_sm < splits) {
      equal_splits = two_per_sm;
    }
    if (plan.longest_first && equal_splits < splits) plan.equal_rows_splits = static_cast<int32_t>(equal_splits);
    // One CTA an SM where the plan's grid is one wave at two an SM and equal rows take one
    // split. At two an SM every CTA of a ragged batch is resident at once, so each SM's share
    // of the work is fixed at the launch, and the SMs that drew two long rows' CTAs set the
    // time; at one an SM the grid is two waves, and the SMs that finish first take the next
    // rows (longest first). H200, thirty-fifth round, B16 64/8 L8192, lengths uniform in
    // [256, 8192]: 65.0-65.5 us against 82.6-87.4 at two an SM; from 4,096: 104.2-104.5 against
    // 111.9-113.6; B30 32/4 from 256: 73.5 against 92.2. Equal rows stream one CTA an SM either
    // way (126.1-126.4 against 126.2-126.7). Nearly equal rows, whose plan's splits would run as
    // two waves of equal halves (from 8,000 of 8,192: 130.4-130.8 against 127.2-128.3), take
    // the equal rows' one split here (decode_schedule.cuh): 125.3-125.5. Where two CTAs an SM
    // stream the equal rows' grid (B8 L32768, B32 L8192) or the grid is two waves already, one
    // CTA an SM was 0.8-7% slower (B8 L8192 69.4 against 66.4, B64 L1024 71.8 against 67.0,
    // ragged B32 L8192 163.5 against 155.2). Measured at head size 128 only.
    plan.one_cta_per_sm = p.head_dim == 128 && plan.equal_rows_splits == 1 && slots * splits <= 2 * sms;
    if (plan.one_cta_per_sm) plan.near_equal_sixteenths = 15;
    // A ragged batch in two waves where the plan's grid is one wave at two CTAs an SM, every
    // CTA of it working for equal rows too. In one wave each SM's share of a ragged batch is
    // fixed at the launch; in two (twice the splits, dispatched longest first) the SMs that
    // finish first take the next CTAs. Equal rows keep the one wave (equal_rows_splits), whose
    // leaving CTAs cost little where two CTAs an SM fill the GPU, and so do ragged batches whose
    // shortest row sees half the longest one's keys or more (the equal rows' grid, in row
    // order): there two waves of short splits cost more than one wave's uneven shares. Where
    // the doubled splits hold 2,048 keys of capacity (the longest they get: the plan's splits
    // are then at most 4,096), two waves pay closer to equal rows, so the bound is 11/16. H200,
    // thirty-sixth round, interleaved, us, two waves / the one wave before:
    //   B8 32/8 L8192, lengths uniform in [256, 8192]  40.8-41.7 / 47.3-48.1
    //   ... from 2,048 / 3,072                          44.4-44.7 / 48.7-50.3, 48.4-48.6 / 52.1-52.3
    //   B8 L16384 from 256 / 4,096                      56.1-56.2 / 71.4-71.8, 90.4-91.2 / 101.8-103.3
    //   B4 L16384 from 256                              48.4-48.5 / 51.2-54.5
    //   B8 L8192 equal rows                             65.3-65.6 / 65.0-65.2 (cuDNN 66.2-66.3)
    // and with the bound, in the equal rows' grid / two waves / the one wave before:
    //   B8 L8192 from 4,096 / 5,000 / 7,000  52.6 / 54.9-55.0 / 54.7, 54.6 / 56.1-56.2 / 56.6-56.9,
    //                                        60.6-60.8 / 63.7 / 61.2-61.6
    //   B8 L16384 from 8,192 / 12,000        105.2-105.3 / 100.8 / 109.6-110.1,
    //                                        108.7-108.8 / 109.4-109.8 / 111.1-111.4
    // and the bound 11/16 against 8/16 there, us: B8 L16384 from 8,192 102.6-102.9 against
    // 107.1-107.6, from 10,000 106.0 against 110.1-110.2, from 11,500 and 12,000 level; B4
    // L32768 from 16,384 97.8-98.0 against 101.0, from 22,000 level.
    // Measured at head size 128 only. The splits stay within the in-launch merge's bound.
    if (p.head_dim == 128 && plan.longest_first && plan.equal_rows_splits == 0 && slots * splits <= 2 * sms &&
        2 * splits <= kMaxInLaunchMergeSplits) {
      plan.equal_rows_splits = static_cast<int32_t>(splits);
      plan.max_splits = static_cast<int32_t>(2 * splits);
      plan.ragged_two_waves = true;
      plan.near_equal_sixteenths = p.capacity / plan.max_splits >= 2048 ? 11 : 8;
    }
    // Equal rows keep the ragged batches' two splits where their items number more than 3/2 of the
    // SMs' count and at most 7/4 of it (199-231 on 132 SMs; the ragged batches' two waves above, or
    // two_per_sm's two splits on 4,096-8,191 keys). In one split a row, one wave of two CTAs an SM,
    // some SMs stream two rows' keys while the rest stream one (B26 32/8: 208 CTAs, 76 SMs with two);
    // in two splits a row, two waves, the SMs that finish first take the next CTAs. H100 (its TMA
    // loaders), stop 81, one process, us, the pin splits=2 (this rule's plan, field for field) / the
    // plan before (SDPA cuDNN): 32/8/128 L4096 B25 139.7 / 153.0 (141.9), B26 145.3-145.6 /
    // 155.3-155.8 (144.4-144.7), B27 151.3 / 157.9 (151.6), B28 156.9-157.2 / 160.0-160.4
    // (157.0-157.2); B28 L6144 231.4-231.8 / 238.2-238.7 (232.1-232.3); B26 L2048 76.9 / 80.2 (75.1);
    // B26 64/8 L4096 147.2 / 156.0 (145.1); B52 28/4 L4096 147.2 / 156.0 (144.8). Level at B29 and B30
    // (232 and 240 items; B32, 256, 176.5 / 173.9) and for ragged batches (B26 and B28 from 256),
    // which took two splits already. Not measured without the TMA loaders. Stop 82:
    // the rule's build level with one split on a second H100 (B25 151.2 / 154.4, B28 167.9 /
    // 164.7, the rest within 1.3%; B26 L2048 79.4 / 81.0), 2.6-7.4% ahead on a third (B25 143.3 /
    // 154.8, B28 160.5 / 164.8). Since then the balanced partition (share_short, below) serves
    // these items on 4,096-8,191 keys where its kernel is built; the rule stays for 2,048-4,095
    // keys and for devices without the TMA kernels. On an H200 (stop 84) the pin splits=2 ran
    // those equal rows as on the third H100 (B25 102.4, B26 105.8, B26 64/8 107.2 us against the
    // partition's 103.3, 108.2, 109.9; B28 level; B28 L6144 168.0 against 166.8).
    if (p.head_dim == 128 && plan.equal_rows_splits == 1 && plan.max_splits == 2 && 2 * slots > 3 * sms &&
        4 * slots <= 7 * sms) {
      plan.equal_rows_splits = 0;
      plan.near_equal_sixteenths = 0;
      plan.ragged_two_waves = false;
    }
    // Equal rows in one split a row whose CTAs end in a partial wave at two an SM. The block
    // dispatcher gives each SM two CTAs of the first wave, and they finish together; the next CTAs
    // then go to the SMs that freed their slots first, two an SM, so a last wave of r CTAs ran on
    // about r / 2 SMs while the rest idled (H200, forty-third round, decode timeline: B48 32/8/64
    // L2048, 384 CTAs, the second wave's 120 on 73 SMs, 47 of them with two; the SMs that ran two
    // CTAs in all idled the last 25 of 60 us). So the rows of that last wave take as many splits
    // each as fill the slots (at most 8, of 256 keys or more): r CTAs of one split become r x
    // tail_splits CTAs of 1 / tail_splits the keys, and the wave takes that fraction of the time. A
    // ragged batch keeps one split a row, dispatched longest first (its SMs free their slots at
    // different times already). H200, forty-third round, interleaved, us, tail splits / one split a
    // row (SDPA cuDNN): B48 32/8/64 L2048 54.4 / 59.2 (49.5), B40 46.6 / 57.1 (42.2), B34 41.4 /
    // 53.4 (36.9), B100 107.6 / 112.7 (99.6), B44 L4096 90.7 / 110.6 (85.4); B48 32/8/128 L2048
    // 97.5 / 99.5 (98.2), L8192 363.7 / 381.3 (374.8), B36 L8192 272.0 / 308.3 (318.8), B40 L4096
    // 152.4 / 178.5 (171.9), B96 28/4/128 L4096 184.4 / 191.7 (189.9); B12 32/32 L4096 at head size
    // 128 180.6 / 189.1 (186.8), 96 149.9 / 174.7 (160.2), B12 32/32/80 L2048 67.7 / 77.9 (72.7). A
    // ragged batch pays for the grid's leaving CTAs: lengths from 256, B48 32/8/64 L2048 34.6 /
    // 34.4, B40 29.05 / 28.9, B44 L4096 55.7 / 55.4, B12 32/32/128 L4096 102.6 / 102.3. At head
    // size 256 with four warps a CTA (one an SM) a wave is the SMs' count, and the launch takes
    // four warps for the grid this gives (decode_mma.cuh). Before, such a grid ran two warps two an
    // SM in one wave, and the SMs that drew two CTAs streamed twice the keys of the others; four
    // warps in plain waves ran the last few slots on their SMs alone. H100, stop 79, one process,
    // interleaved, us, this rule / the grid of two warps before (the schedule pin keep_splits runs
    // it) / four warps in plain waves (SDPA flash): B17 32/8/256 L2048 (136 slots) 104.2 / 114.6 /
    // 121.7 (112.0), lengths from 256 66.2 / 79.5 / 65.9; B18 16/8/256 L2100 110.1 / 129.1 / 125.4
    // (115.6); B20 16/8/256 L4096 223.9 / 261.5 / 255.6 (227.3), from 256 129.5 / 160.4 / 129.7;
    // B24 16/8/256 L4096 263.9 / 298.5 / 270.3 (265.6), from 256 151.5 / 190.9 / 151.5; B34 8/4/256
    // L4096 187.5 / 222.2 / 220.2 (196.0). H200, stop 84, one process, us, this rule / keep_splits:
    // B17 32/8/256 L2048 80.4 / 78.5, from 256 52.6 / 74.4; B24 16/8/256 L4096 188.6 / 219.4. Not
    // measured at head size 256 with two warps only (no sm90a build), which keeps the wave of two
    // an SM.
    const int64_t wave = four_warps ? sms : 2 * sms;
    const int64_t tail = slots % wave;
    if (plan.longest_first && splits == 1 && plan.equal_rows_splits == 0 && (p.head_dim <= 128 || four_warps) &&
        slots > wave && tail > 0 && 2 * tail <= wave) {
      int64_t tail_splits = wave / tail;
      if (tail_splits > 8) tail_splits = 8;
      while (tail_splits > 2 && p.capacity / tail_splits < 256) --tail_splits;
      plan.max_splits = static_cast<int32_t>(tail_splits);
      plan.equal_rows_splits = 1;
      plan.ragged_splits = 1;
      plan.equal_rows_tail_splits = static_cast<int32_t>(tail_splits);
      plan.equal_rows_tail_items = static_cast<int32_t>(tail);
    }
    // A balanced partition (Plan::shares): a grid of one CTA an SM, each CTA an equal share of
    // the batch's keys, each item weighed by its keys plus share_item_keys (what a segment costs
    // besides its keys); an item spans at most kMaxInLaunchMergeSplits CTAs (shares_walk bounds
    // the share from below). Where the items do not divide the SMs, the grid of splits leaves
    // SMs idle or shares them unevenly, and it spreads a ragged batch only by its splits. Taken
    // at head size 128, on 8,192 keys of capacity or more, in three bands of the items' count
    // (and one more on 4,096-8,191 keys, share_short), and at head size 64 in two (share_64).
    // Its kernel runs on the TMA loaders alone (DeviceInfo::decode_tma_kernels); without them the
    // same bands take a plain grid of kMaxInLaunchMergeSplits splits an item in the rows' order
    // (take_partition_splits), which is what the launch ran there before stop 81 made it the
    // plan's own. An H100 under an A100's budget of shared memory (163 KB, its cp.async kernels;
    // stop 81, one process, interleaved, us, these / the grid of splits (SDPA cuDNN)): B12 64/8
    // L16384 284.6 / 319.3-327.0 (262.4), B30 32/8 L16384 684.2 / 725.4-736.2 (661.0), B6 64/8
    // L16384 146.7 / 154.6-155.8, B9 16/8 L8192 108.2 / 121.4, B20 32/8 L4096 122.3 / 145.6-146.5
    // (122.9), lengths from 256 B12 64/8 L8192 69.2 / 75.4-75.7; head size 64, B20 32/8 L4096
    // 68.0 / 74.0-75.8 (58.8), B12 L8192 75.9 / 86.2-86.7, from 256 39.0 / 50.8; slower only at
    // B16 64/8 L8192 194.3 / 186.4-186.6 (175.9) and B20 32/8 L4096 from 256 74.3 / 71.8-73.2.
    // Under sm86's 99 KB (two warps a CTA at 128) the same, B30 688.2 / 815.4-834.8.
    // H200, interleaved, us, this / the grid of splits (SDPA cuDNN), NOTES.md:
    // - share_band, more than half the SMs' count and at most 7/4 of it (forty-ninth and
    //   fiftieth rounds). Equal rows: B12 64/8 L16384 189.7 / 225.7 (188.2); B16 248.9 / 302.0
    //   (242.3); B9 144.3 / 160.8 (161.3); B14 L8192 115.0 / 125.2 (110.0); B16 L8192 126.4 /
    //   126.3 (123.3); B24 64/8 L8192 186.0 / 221.3 (191.0). Lengths from 256: B12 64/8 L8192
    //   49.1 / 53.3; B16 L16384 167.4 / 176.2; B9 L16384 94.0 / 97.9; B15 L16384 117.2 / 117.4;
    //   B16 L32768 296.5 / 297.3; B30 32/4 L8192 72.5 / 72.8; B14 L8192 47.9 / 46.7.
    // - share_few, 1/8 of it to half, where the equal rows' grid of splits leaves 1/16 of its
    //   slots empty or more at two CTAs an SM, or 1/4 of the SMs idle at one (fifty-first round).
    //   B6 64/8 L16384 (48 items, 240 of 264 slots) 97.0 / 102.3 (101.6); B7 32/8 L16384 (56,
    //   224) 109.5 / 121.0 (113.8); B5 32/8 L16384 (40, 240) 80.7 / 84.4 (83.9); B14 28/4 L8192
    //   (56, 224) 61.0 / 65.5 (61.1); B6 32/8 L8192 (48, 96 of 132 SMs) 52.3-53.3 / 53.3-53.5,
    //   with lengths from 256 30.4-30.8 / 50.6-50.8. Not where the grid fills more: B8 32/8
    //   L8192 (64, 256 of 264) 66.5-66.9 / 65.0; B3 64/8 L32768 (24, 264) 96.1-96.5 / 95.3; B5
    //   32/8 L8192 (40, 120 of 132 SMs) 44.9 / 42.8 (with lengths from 256 28.2 / 31.9); B3 64/8
    //   L8192 31.0 / 29.0.
    // - share_long, more than 7/4 of it and at most 4 x on 16,384 keys or more (fifty-first
    //   round). B30 32/8 L16384 (240 items) 442.0 / 469.0 (446.9); B32 32/8 L32768 928.4 / 942.5
    //   (924.4); B64 L32768 1845.5 / 1858.6 (1848.4), lengths from 256 915.5 / 928.0; B40
    //   L16384 lengths from 256 282.3 / 334.0; B64 L16384 level (931.8 / 930.9; lengths from 256
    //   482.2 / 480.0). Past 4 x, ragged batches lose: B128 32/8 L16384 1851.1 / 1884.7 but
    //   1005.0 / 987.0 from 256, L32768 3767.0 / 3856.9 but 1985.2 / 1942.5. On 8,192 keys the
    //   grid of splits is level or faster from about twice the SMs (fiftieth round: B32 32/8
    //   240.5 / 239.1; B64 473.3 / 469.6, from 256 274.9 / 264.6; B128 L2048 258.9 / 244.5;
    //   B64 L1024 77.8 / 65.2).
    // The item weight 512 (forty-ninth round): ragged B12 64/8 L8192 at 0 / 192 / 320 / 512 keys
    // 73.0 / 55.7 / 51.4 / 49.4, B15 L16384 136.0 / 121.6 / 119.1 / 118.3 (one process; in
    // another, 1,024 keys 52.8 and 120.7 against 49.1 and 117.2 at 512); equal rows level across
    // weights.
    // The CTAs of a batch of equal rows in the grid of splits, and the slots of its waves at two
    // CTAs an SM.
    const int64_t equal_grid = slots * (plan.equal_rows_splits > 0 ? plan.equal_rows_splits : plan.max_splits);
    const int64_t equal_slots = (equal_grid + 2 * sms - 1) / (2 * sms) * 2 * sms;
    const bool share_band = 2 * slots > sms && 4 * slots <= 7 * sms;
    const bool share_few = 8 * slots >= sms && 2 * slots <= sms &&
                           (equal_grid <= sms ? 4 * equal_grid <= 3 * sms : 16 * equal_grid < 15 * equal_slots);
    const bool share_long = p.capacity >= 16384 && 4 * slots > 7 * sms && slots <= 4 * sms;
    // share_short: share_band's items from more than the SMs' count to 3/2 of it (to 7/4 where the
    // TMA kernels are built, stop 82 below), on 4,096 to 8,191 keys of capacity. There a batch of
    // equal rows runs one split a row, one CTA a slot (ragged_two_waves), and some SMs hold two.
    // H100, stop 79, interleaved builds, two runs, us, this / the grid of splits (SDPA cuDNN): B17
    // 32/8 L4096 98.9 / 104.5 (96.2); B20 115.3 / 129.4 (120.5); B24 136.8 / 148.9 (137.0); B40
    // 28/4 L4096 116.7 / 129.6 (120.5); lengths from 256: B20 65.5 / 64.9. Not taken: fewer items
    // (B9 64/8 L4096, 72 items, 56.8 / 52.2; B16 32/8 L4096 90.4 / 89.6), more (B28 32/8 L4096, 224
    // items, 158.2 / 160.8 but from 256 86.4 / 83.4), 2,048 keys (B20 32/8 L2048 62.2 / 66.4, but
    // B16 47.8 / 46.7). H200, stop 84, this / one split a row (the pin splits=1; cuDNN): B20 84.3 /
    // 107.3 (82.6), B24 99.4 / 112.3 (99.2), B40 86.3 / 108.3 (82.6). Stop 82 took it up to 7/4 of
    // the SMs' count (199-231 items) where its kernel is built. On a second H100, one process, us,
    // this / stop 81's two splits a row / one split a row (SDPA cuDNN): B25 32/8 L4096 146.4 /
    // 151.2 / 154.4 (142.2); B26 151.8 / 158.3 / 157.7 (147.9); B28 162.1 / 167.9 / 164.7 (159.4);
    // B28 L6144 237.9 / 248.6 / 248.6 (237.6); B26 64/8 L4096 152.9 / 158.4 / 158.3 (148.4); B52
    // 28/4 L4096 153.3 / 158.1 / 157.9 (148.5). Ragged batches (lengths from 256) lost 1-3%: B25
    // 75.8 / 74.7, B28 87.8 / 85.4, B28 L6144 121.2 / 120.0. A third H100 ran the two splits as
    // stop 81's did (B25 143.3, B26 149.0, B28 160.5, B26 64/8 150.5, us), 1.2-2.3% ahead of the
    // partition on equal rows (level at L6144), 0-7% behind it on ragged batches (B25 78.9 / 75.2,
    // B26 64/8 79.2 / 73.6). The partition's times agree across cards (B25 146.4 and 146.5); the
    // two splits' do not (151.2, 143.3, and 139.7 on stop 81's card). Without the TMA kernels these
    // items keep the two splits (above), unmeasured against 16 splits an item.
    const bool share_short = p.capacity >= 4096 && slots > sms &&
                             (2 * slots <= 3 * sms || (device.decode_tma_kernels && 4 * slots <= 7 * sms));
    // At head size 64 (its kernel on the TMA loader's 32-key slices), on 4,096 keys of capacity or
    // more: from more than the SMs' count to 3/2 of it (share_short's band before stop 82, which
    // head size 64 keeps: 224 items were level, below), and from 2/3 of the SMs' count to 7/8 of
    // it, where the equal rows' grid of splits holds some SMs' two CTAs while others idle. Between
    // 7/8 and the SMs' count one CTA an item (no split) is one wave already. H100, stop 80, one
    // process, interleaved, us, this / the grid of splits (SDPA cuDNN): 32/8/64 L4096 B12 (96
    // items) 39.5 / 41.5 (38.1), B17 (136) 52.7 / 54.6 (49.7), B20 60.9 / 65.6 (57.6), B24 71.5 /
    // 76.1 (67.8); L8192 B12 71.5 / 77.4 (72.0), B20 113.6 / 131.0 (110.7), B24 134.8 / 149.9
    // (130.8); B12 L16384 134.2 / 150.8 (139.5); lengths from 256: B20 L4096 36.4 / 40.0, B12 L8192
    // 35.3 / 41.4. Not taken: B9 L4096 (72 items) 31.8 / 27.8, B16 L4096 (128) 47.3 / 46.4, B64
    // 14/2/64 L4096 (128) 48.6 / 46.7, B28 L4096 (224) 82.4 / 82.8, 2,048 keys (B20 34.5 / 34.9,
    // B24 40.1 / 40.0, from 256 26.7 / 25.6; B80 14/2/64 36.1 / 35.6). H200, stop 84, this against
    // SDPA cuDNN alone (no pin gives back the grid of splits): B20 L4096 45.7 (44.8), B12 L8192
    // 53.4 (64.2), B20 L4096 from 256 29.1 (44.8).
    const bool share_64 = p.capacity >= 4096 &&
                          ((3 * slots > 2 * sms && 8 * slots < 7 * sms) || (slots > sms && 2 * slots <= 3 * sms));
    const bool share_128 = p.capacity >= 8192 ? share_band || share_long || share_few : share_short;
    if (p.batch >= 2 && p.batch <= 128 && (p.head_dim == 128 ? share_128 : p.head_dim == 64 && share_64)) {
      if (device.decode_tma_kernels) {
        take_shares(plan, sms, kShareItemKeys);
      } else {
        take_partition_splits(plan);
      }
    }
  } else {
    // A short query chunk on a long cache (speculative verification, small chunks) has few
    // query blocks, so few CTAs would each stream the whole cache while most SMs idle. Then
    // the key range of each query block is split (merged as in decode), enough to fill the
    // SMs, each split at least 1024 keys of the capacity. The tensor-core prefill takes it;
    // the kernels that do not split ignore it (launch.cu).
    plan.max_splits = 1;
    plan.min_split_keys = 0;
    const int64_t rows = static_cast<int64_t>(p.query_len) * (p.kv_heads > 0 ? p.q_heads / p.kv_heads : 1);
    const int64_t ctas = (rows + 127) / 128 * p.kv_heads * p.batch;  // query blocks of <= 128 rows
    if (ctas > 0 && ctas < device.sm_count && p.capacity >= 2048) {
      int64_t splits = device.sm_count / ctas;
      const int64_t by_capacity = p.capacity / 1024;
      if (splits > by_capacity) splits = by_capacity;
      if (splits > 32) splits = 32;
      // Scratch bound: 64 MiB of partial outputs.
      const int64_t per_split = static_cast<int64_t>(p.batch) * p.query_len * p.q_heads * p.head_dim * 4;
      while (splits > 1 && per_split * splits > (64LL << 20)) --splits;
      if (splits > 1) plan.max_splits = static_cast<int32_t>(splits);
    }
  }

  layout_workspace(plan, p);
  return plan;
}

void clear_split_grid_rules(Plan& plan) {
  plan.equal_rows_splits = 0;
  plan.one_cta_per_sm = false;
  plan.near_equal_sixteenths = 0;
  plan.ragged_two_waves = false;
  plan.equal_rows_tail_splits = 0;
  plan.equal_rows_tail_items = 0;
  plan.ragged_splits = 0;
}

void take_partition_splits(Plan& plan) {
  plan.max_splits = kMaxInLaunchMergeSplits;
  plan.longest_first = false;
  clear_split_grid_rules(plan);
}

void take_shares(Plan& plan, int64_t sms, int32_t item_keys) {
  take_partition_splits(plan);
  plan.shares = static_cast<int32_t>(sms);
  plan.share_item_keys = item_keys;
}

void layout_workspace(Plan& plan, const Params& p) {
  // Count, then carve. Split-K (decode, or prefill of a short chunk) needs the partials, and
  // prefill its kernels' query-block counter.
  plan.workspace = WorkspaceLayout{};
  size_t offset = 0;
  if (plan.max_splits > 1) {
    const size_t heads = static_cast<size_t>(p.batch) * p.query_len * p.q_heads * plan.max_splits;
    plan.workspace.partial_out = offset;
    offset += align_workspace(sizeof(float) * heads * p.head_dim);
    plan.workspace.partial_lse = offset;
    offset += align_workspace(sizeof(float) * heads);
  }
  if (plan.route == Route::kPrefill) {
    plan.workspace.work_counter = offset;
    offset += align_workspace(sizeof(int32_t));
  }
  plan.workspace.total_bytes = offset;
}

}  // namespace gqa
