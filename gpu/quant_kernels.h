// The device's kernel for the packed base (Note [The packed 4-bit base] in common/bnb4_blob.h),
// beside the Device interface as the optimizer kernels are: the parameter coordinator copies a
// frozen 4-bit or 8-bit weight to the device as its blob and dequantizes it there into the compute
// dtype. Found by the device's kind; thread-safe like Device.
#pragma once

#include <cstdint>

#include "common/dtype.h"
#include "common/status.h"
#include "gpu/device.h"

namespace zo::gpu {

struct DequantizePackedArgs {
  DevicePtr blob;                  // blob_bytes bytes, its header written by the host
  uint64_t blob_bytes = 0;         // the blob's size: BlobHeader::bytes() of its header
  DevicePtr out;                   // n_elems elements of out_dtype
  DType out_dtype = DType::kBF16;  // the compute dtype
  uint64_t n_elems = 0;            // the weight's elements (rows × cols of the header)
};

// Queues on `stream` the dequantization of a blob into `out` and returns at once: element i is
// bnb4::blob_element — a 4-bit blob's table[code] × absmax in fp32 rounded to the header's dtype,
// as bitsandbytes' dequantize_4bit gives it; an 8-bit blob's code × (SCB × 1/127) in fp32, as its
// training path computes it — rounded to out_dtype to nearest even: the same scalar code on every
// backend (CudaDevice one thread per element, HostDevice a loop on the stream's worker thread), so
// the bits are the host's. The header is read where the kernel runs and trusted: the store wrote
// it (bnb4::read_blob_header checks it on the host). InvalidArgument, with nothing queued, when
// blob_bytes is smaller than any blob of n_elems weights, a range (blob_bytes at `blob`, n_elems at
// `out`) is not inside one live allocation of `device`, the output is not aligned to its element,
// the two overlap, or out_dtype is unknown; n_elems == 0 queues nothing. Moves no bytes in stats().
Status dequantize_packed(Device& device, const DequantizePackedArgs& args, Stream stream);

}  // namespace zo::gpu
