// Peak resident memory of one computation. Linux keeps a per-process high-water mark (VmHWM in
// /proc/self/status); writing "5" to /proc/self/clear_refs resets it to the current RSS (kernel >=
// 4.0), so "reset, run, read VmHWM" measures the peak of that computation alone. Verified at run
// time by hwm_reset_works(); without it the memory columns are NaN.
#pragma once

namespace linrope::experiments {

double current_rss_mib();  // VmRSS, MiB; NaN if unreadable
double peak_rss_mib();     // VmHWM, MiB; NaN if unreadable
bool reset_peak_rss();     // true if the kernel accepted the reset
// Self-test (once, cached): touch 64 MiB, free it, reset; the peak must drop by most of it.
bool hwm_reset_works();
double available_memory_mib();  // MemAvailable from /proc/meminfo; NaN if unreadable

}  // namespace linrope::experiments
