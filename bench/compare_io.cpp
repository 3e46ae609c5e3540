// compare_io: one attention call of linrope on raw float32 files, for bench/compare_pytorch.py to
// check that PyTorch and linrope compute the same thing (and, with --repeat, to time the call).
//
//   compare_io --kind softmax|elu|favor --causal 0|1
//              --placement none|numerator_only|full|before_map --method chunked|scan
//              --chunk C --seed S --m M --batch B --heads H --n N --d D
//              --q q.bin --k k.bin --v v.bin --out out.bin [--w w.bin] [--repeat R]
//   compare_io ... (the same) --d-out d_out.bin --dq dq.bin --dk dk.bin --dv dv.bin
//

// q, k, v: float32, [B, H, N, D] contiguous (PyTorch's x.contiguous().numpy().tofile()); d_v = D.
// out: float32 [B, H, N, D]. kind favor: FavorPositive with M orthogonal features drawn from seed S
// (elu: m = D, M ignored); --w writes its projection W [M x D] (double in linrope, written as
// float32 row-major) so that PyTorch can build the same features. RoPE (placements other than
// none): interleaved, base 10000, width D for before_map, m otherwise. Softmax: scale 1/sqrt(D),
// no rope. --repeat R > 0 runs the call R more times and prints "median_ms <t>" (wall clock).
// Backward (--d-out given): the gradients of L = sum(d_out * out) instead of the output, through
// the batched *_backward call with the same options; d_out, dq, dk, dv float32 [B, H, N, D]
// (--out is then not read; --repeat times the backward call).
// Exit status 1 with a message on stderr for bad arguments or an error thrown by linrope.
#include <algorithm>
#include <chrono>
#include <exception>
#include <fstream>
#include <iostream>
#include <linrope/linrope.hpp>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using linrope::Index;

struct Args {
  std::map<std::string, std::string> values;

  std::string get(const std::string& key, const std::string& fallback = "") const {
    const auto it = values.find(key);
    if (it != values.end()) return it->second;
    if (fallback.empty()) throw std::invalid_argument("missing --" + key);
    return fallback;
  }
  Index number(const std::string& key, const std::string& fallback = "") const {
    const std::string text = get(key, fallback);
    std::size_t used = 0;
    const long long value = std::stoll(text, &used);
    if (used != text.size())
      throw std::invalid_argument("--" + key + " is not an integer: " + text);
    return Index(value);
  }
};

Args parse(int argc, char** argv) {
  Args args;
  for (int i = 1; i < argc; ++i) {
    const std::string key = argv[i];
    if (key.rfind("--", 0) != 0 || i + 1 >= argc)
      throw std::invalid_argument("expected --name value pairs, got " + key);
    args.values[key.substr(2)] = argv[++i];
  }
  return args;
}

std::vector<float> read_floats(const std::string& path, Index count) {
  std::ifstream file(path, std::ios::binary);
  if (!file) throw std::invalid_argument("cannot open " + path);
  std::vector<float> x(static_cast<std::size_t>(count));
  file.read(reinterpret_cast<char*>(x.data()), std::streamsize(count * Index(sizeof(float))));
  if (file.gcount() != std::streamsize(count * Index(sizeof(float))))
    throw std::invalid_argument(path + " holds fewer than " + std::to_string(count) + " floats");
  if (file.peek() != std::char_traits<char>::eof())
    throw std::invalid_argument(path + " holds more than " + std::to_string(count) + " floats");
  return x;
}

void write_floats(const std::string& path, const float* x, Index count) {
  std::ofstream file(path, std::ios::binary);
  file.write(reinterpret_cast<const char*>(x), std::streamsize(count * Index(sizeof(float))));
  if (!file) throw std::runtime_error("cannot write " + path);
}

int run(const Args& args) {
  const std::string kind = args.get("kind");
  const bool causal = args.number("causal", "0") != 0;
  const Index batch = args.number("batch", "1"), heads = args.number("heads"), n = args.number("n"),
              d = args.number("d");
  const Index count = batch * heads * n * d;
  const std::vector<float> q = read_floats(args.get("q"), count),
                           k = read_floats(args.get("k"), count),
                           v = read_floats(args.get("v"), count);
  // Backward mode: d_out in, and one buffer per gradient (dq, dk, dv) besides out.
  const bool backward = args.values.count("d-out") != 0;
  const std::vector<float> d_out =
      backward ? read_floats(args.get("d-out"), count) : std::vector<float>();
  std::vector<float> out(static_cast<std::size_t>(count)), dq, dk, dv;
  if (backward) dq = dk = dv = out;
  const auto view = [&](const std::vector<float>& x) {
    return linrope::Heads<const float>{
        .data = x.data(), .batch = batch, .heads = heads, .n = n, .d = d};
  };
  const auto writable = [&](std::vector<float>& x) {
    return linrope::Heads<float>{.data = x.data(), .batch = batch, .heads = heads, .n = n, .d = d};
  };
  const linrope::Heads<float> out_view = writable(out);

  std::unique_ptr<linrope::FeatureMap> map;
  std::optional<linrope::Rope> rope;
  linrope::LinearOptions linear;
  if (kind == "elu" || kind == "favor") {
    const bool favor = kind == "favor";
    using linrope::FeatureMapKind;
    map = linrope::make_feature_map(
        {.kind = favor ? FeatureMapKind::FavorPositive : FeatureMapKind::EluPlusOne,
         .input_dim = d,
         .num_features = favor ? args.number("m") : 0,
         .orthogonal = true,
         .seed = std::uint64_t(args.number("seed", "0"))});
    linear.causal = causal;
    linear.placement = linrope::rope_placement_from_string(args.get("placement", "none"));
    linear.method = linrope::causal_method_from_string(args.get("method", "chunked"));
    linear.chunk_size = args.number("chunk", "64");
    if (linear.placement != linrope::RopePlacement::None) {
      rope.emplace(linrope::RopeConfig{
          .dim = linear.placement == linrope::RopePlacement::BeforeMap ? d : map->output_dim()});
      linear.rope = &*rope;
    }
    if (favor && args.values.count("w")) {
      const linrope::MatrixF w = map->projection().cast<float>();
      write_floats(args.get("w"), w.data(), w.size());
    }
  } else if (kind != "softmax") {
    throw std::invalid_argument("--kind is " + kind + " but expected softmax, elu or favor");
  }

  const auto call = [&] {
    if (backward && map)
      linrope::linear_attention_backward(view(q), view(k), view(v), view(d_out), writable(dq),
                                         writable(dk), writable(dv), *map, linear);
    else if (backward)
      linrope::softmax_attention_backward(view(q), view(k), view(v), view(d_out), writable(dq),
                                          writable(dk), writable(dv), {.causal = causal});
    else if (map)
      linrope::linear_attention(view(q), view(k), view(v), out_view, *map, linear);
    else
      linrope::softmax_attention(view(q), view(k), view(v), out_view, {.causal = causal});
  };
  call();
  if (backward) {
    write_floats(args.get("dq"), dq.data(), count);
    write_floats(args.get("dk"), dk.data(), count);
    write_floats(args.get("dv"), dv.data(), count);
  } else {
    write_floats(args.get("out"), out.data(), count);
  }

  const Index repeat = args.number("repeat", "0");
  if (repeat > 0) {
    std::vector<double> ms;
    for (Index r = 0; r < repeat; ++r) {
      const auto start = std::chrono::steady_clock::now();
      call();
      ms.push_back(
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
              .count());
    }
    std::sort(ms.begin(), ms.end());
    std::cout << "median_ms " << ms[ms.size() / 2] << '\n';
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(parse(argc, argv));
  } catch (const std::exception& e) {
    std::cerr << "compare_io: " << e.what() << '\n';
    return 1;
  }
}
