// Document masking for packed sequences (Megatron's reset_attention_mask + reset_position_ids,
// the Llama 3 recipe): a training sequence of T tokens cut from concatenated documents holds
// pieces of several, each ended by an end-of-document token. With masking, a token attends only
// to earlier tokens of its own document, and its position (RoPE's angle, GPT-2's learned
// position row) counts from its document's first token in the sequence.
//
// Both follow from one array, the position of each row within its document:
//   pos[first row of a sequence] = 0,  pos[n] = 0 if tokens[n-1] is the end-of-document token,
//   else pos[n-1] + 1.
// Row n then attends rows n - pos[n] .. n (AttnShape::positions).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace keel {

// Positions of N = B * T input tokens (B sequences of T, row-major); eod: the token that ends a
// document (it belongs to the document it ends).
std::vector<int32_t> document_positions(const int32_t* tokens, int64_t N, int T, int32_t eod);

// Why p[0, N) is not an array document_positions could make ("" when it is one): the first
// row of each sequence of T is 0 and every other row is 0 or one more than the row before.
std::string document_positions_error(const int32_t* p, int64_t N, int T);

}  // namespace keel
