#include "interrupt.hpp"

#include <atomic>
#include <csignal>
#include <string>

namespace linrope::experiments {

namespace {

// Written only by the handler (and cleared by InterruptHandlers outside any handler). A handler may
// do almost nothing safely (no allocation, no stdio, no locks). A lock-free atomic rather than a
// volatile sig_atomic_t: the kernel may run the handler on any thread (OpenMP's included), and
// only an atomic makes that store visible to the main thread without a data race.
std::atomic<int> received_signal{0};
static_assert(std::atomic<int>::is_always_lock_free, "the signal handler needs a lock-free flag");

void record_signal(int signal) { received_signal.store(signal, std::memory_order_relaxed); }

void install(int signal, struct sigaction& previous) {
  sigaction(signal, nullptr, &previous);
  // A signal ignored when the program started (nohup, `trap '' INT`, a background job of a
  // non-interactive shell) stays ignored, as the caller asked.
  if (previous.sa_handler == SIG_IGN) return;
  struct sigaction action {};
  action.sa_handler = &record_signal;
  sigemptyset(&action.sa_mask);
  // SA_RESETHAND: one-shot, so the second Ctrl-C takes the default action (force quit).
  // SA_RESTART: a read or write under way when the signal comes resumes instead of failing with
  // EINTR, so that saving the CSV is not what the signal breaks.
  action.sa_flags = SA_RESETHAND | SA_RESTART;
  sigaction(signal, &action, &previous);
}

}  // namespace

InterruptHandlers::InterruptHandlers() {
  received_signal = 0;
  install(SIGINT, previous_int_);
  install(SIGTERM, previous_term_);
}

InterruptHandlers::~InterruptHandlers() {
  sigaction(SIGINT, &previous_int_, nullptr);
  sigaction(SIGTERM, &previous_term_, nullptr);
  received_signal = 0;
}

int interrupt_signal() { return received_signal.load(std::memory_order_relaxed); }

std::string signal_name(int signal) {
  if (signal == SIGINT) return "SIGINT";
  if (signal == SIGTERM) return "SIGTERM";
  return "signal " + std::to_string(signal);
}

Interrupted::Interrupted(int signal, std::filesystem::path csv, std::size_t saved,
                         std::size_t total)
    : std::runtime_error("interrupted (" + signal_name(signal) + "); " + std::to_string(saved) +
                         " of " + std::to_string(total) + " points saved to " + csv.string()),
      signal_(signal),
      csv_(std::move(csv)),
      saved_(saved),
      total_(total) {}

}  // namespace linrope::experiments
