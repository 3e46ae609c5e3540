// linrope: linear attention with Rotary Position Embedding. The one header to include.
#pragma once

#include <linrope/activation.hpp>
#include <linrope/attention.hpp>
#include <linrope/batched.hpp>
#include <linrope/feature_maps.hpp>
#include <linrope/matmul.hpp>
#include <linrope/normalization.hpp>
#include <linrope/random.hpp>
#include <linrope/rope.hpp>
#include <linrope/types.hpp>
#include <linrope/version.hpp>
