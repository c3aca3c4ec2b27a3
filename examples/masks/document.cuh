// A document mask for packed sequences (fagen's worked example of a custom mask): each query row
// attends causally to the keys of its own document only. Compiled into the kernels ahead of time
// (examples/masks/document.yaml); at run time the caller passes the documents:
//
//     out = fagen.torch.flash_attn_func(q, k, v, mask_mod="document", mask_args=document_ids)
//
// mask_args: int32 (batch, seqlen), each position's document id, non-decreasing along a row
// (documents packed one after another); seqlen_q == seqlen_k (queries and keys are the same
// positions). The type follows templates/include/fagen/algo/mask.cuh's CustomMask: `of` builds
// it per batch row, `masked` is the element mask, and the two ranges let the kernels skip the
// blocks of other documents, so that the time follows the documents' lengths, not seqlen.
#pragma once
#include "fagen/algo/mask.cuh"

struct DocumentMask {
    const int* document;  // this batch row's document ids
    int length;

    static __device__ DocumentMask of(const void* mask_args, int batch, int /*seqlen_q*/, int seqlen_k) {
        return {static_cast<const int*>(mask_args) + static_cast<long long>(batch) * seqlen_k, seqlen_k};
    }

    __device__ bool masked(int row, int key) const { return key > row || document[key] != document[row]; }

    // The first position of `position`'s document: a binary search over the sorted ids.
    __device__ int document_begin(int position) const {
        const int id = document[position];
        int low = 0, high = position;
        while (low < high) {
            const int middle = (low + high) / 2;
            if (document[middle] < id) low = middle + 1; else high = middle;
        }
        return low;
    }

    // One past the last position of `position`'s document.
    __device__ int document_end(int position) const {
        const int id = document[position];
        int low = position + 1, high = length;
        while (low < high) {
            const int middle = (low + high) / 2;
            if (document[middle] <= id) low = middle + 1; else high = middle;
        }
        return low;
    }

    // Rows [row_begin, row_end) see keys from their first row's document start up to the last
    // row (causal).
    __device__ fagen::algo::IndexRange keys_of_rows(int row_begin, int row_end) const {
        return {document_begin(row_begin), row_end};
    }

    // Keys [key_begin, key_end) are seen by the rows from the first key up to the end of the last
    // key's document.
    __device__ fagen::algo::IndexRange rows_of_keys(int key_begin, int key_end) const {
        return {key_begin, document_end(key_end - 1)};
    }

    // Every row sees every key of the block: one document (the ids are sorted, so its first key's
    // and last row's agree), and the keys at or before the first row. The kernels then skip the
    // element mask, which reads two ids per score.
    __device__ bool all_visible(int row_begin, int row_end, int key_begin, int key_end) const {
        return key_end - 1 <= row_begin && document[key_begin] == document[row_end - 1];
    }
};
