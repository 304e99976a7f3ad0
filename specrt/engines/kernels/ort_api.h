// The parts of onnxruntime's C API this library uses, declared from its documentation (onnxruntime's
// "C API" reference, onnxruntime_c_api.h). No package this project can install ships that header, so each
// function is named here by its index in the OrtApi table, which only ever grows at its end. Every index
// below was checked against the published header (API version 24, onnxruntime 1.24); the library asks for
// version 17 (onnxruntime 1.17), the first with KernelContext_ParallelFor. Two checks guard the indices:
// built where the header is on the include path (setup.py looks for it; SPECRT_ORT_INCLUDE names a folder),
// each index is asserted against it at compile time; and at load, RegisterCustomOps calls every function
// it can outside a kernel on known values and refuses the library, in one line, if one answers wrong
// (ort_op.cc, check_api).
#pragma once

#include <cstddef>
#include <cstdint>

// tests/test_kernel.py builds the library with this set to 64 (GetTensorShapeElementCount, the same
// signature): a wrong index that check_api must catch
#ifndef SPECRT_ORT_DIMENSIONS_COUNT
#define SPECRT_ORT_DIMENSIONS_COUNT 61
#endif

namespace ort {

struct Status;
struct KernelInfo;
struct KernelContext;
struct Value;
struct TensorInfo;
struct SessionOptions;
struct CustomOpDomain;
struct MemoryInfo;

constexpr uint32_t kApiVersion = 17;

struct ApiBase {  // OrtApiBase
  const void* const* (*GetApi)(uint32_t version);
  const char* (*GetVersionString)();
};

enum ElementType : int { kUndefined = 0, kFloat = 1, kUint8 = 2, kInt32 = 6 };  // ONNXTensorElementDataType
enum ErrorCode : int { kFail = 1, kInvalidArgument = 2 };           // OrtErrorCode
enum Characteristic : int { kRequired = 0, kOptional = 1 };         // OrtCustomOpInputOutputCharacteristic

// OrtCustomOp up to the members of its version 17 (onnxruntime reads no further for that version).
struct CustomOp {
  uint32_t version;
  void* (*CreateKernel)(const CustomOp*, const void* api, const KernelInfo*);
  const char* (*GetName)(const CustomOp*);
  const char* (*GetExecutionProviderType)(const CustomOp*);
  ElementType (*GetInputType)(const CustomOp*, size_t index);
  size_t (*GetInputTypeCount)(const CustomOp*);
  ElementType (*GetOutputType)(const CustomOp*, size_t index);
  size_t (*GetOutputTypeCount)(const CustomOp*);
  void (*KernelCompute)(void* kernel, KernelContext*);
  void (*KernelDestroy)(void* kernel);
  Characteristic (*GetInputCharacteristic)(const CustomOp*, size_t index);
  Characteristic (*GetOutputCharacteristic)(const CustomOp*, size_t index);
  int (*GetInputMemoryType)(const CustomOp*, size_t index);
  int (*GetVariadicInputMinArity)(const CustomOp*);
  int (*GetVariadicInputHomogeneity)(const CustomOp*);
  int (*GetVariadicOutputMinArity)(const CustomOp*);
  int (*GetVariadicOutputHomogeneity)(const CustomOp*);
  Status* (*CreateKernelV2)(const CustomOp*, const void* api, const KernelInfo*, void** kernel);
  Status* (*KernelComputeV2)(void* kernel, KernelContext*);
  Status* (*InferOutputShapeFn)(const CustomOp*, void* shape_infer_context);
  int (*GetStartVersion)(const CustomOp*);
  int (*GetEndVersion)(const CustomOp*);
};

// The functions used, each at its index in the OrtApi table.
class Api {
 public:
  explicit Api(const void* const* table) : t_(table) {}

  Status* CreateStatus(ErrorCode code, const char* msg) const {
    return fn<Status* (*)(ErrorCode, const char*)>(0)(code, msg);
  }
  ErrorCode GetErrorCode(const Status* s) const { return fn<ErrorCode (*)(const Status*)>(1)(s); }
  const char* GetErrorMessage(const Status* s) const { return fn<const char* (*)(const Status*)>(2)(s); }
  Status* CreateTensorWithDataAsOrtValue(const MemoryInfo* info, void* data, size_t bytes, const int64_t* shape,
                                         size_t rank, ElementType type, Value** out) const {
    return fn<Status* (*)(const MemoryInfo*, void*, size_t, const int64_t*, size_t, ElementType, Value**)>(49)(
        info, data, bytes, shape, rank, type, out);
  }
  Status* CreateCpuMemoryInfo(int allocator_type, int mem_type, MemoryInfo** out) const {
    return fn<Status* (*)(int, int, MemoryInfo**)>(69)(allocator_type, mem_type, out);
  }
  void ReleaseMemoryInfo(MemoryInfo* m) const { fn<void (*)(MemoryInfo*)>(94)(m); }
  void ReleaseValue(Value* v) const { fn<void (*)(Value*)>(96)(v); }
  void ReleaseCustomOpDomain(CustomOpDomain* d) const { fn<void (*)(CustomOpDomain*)>(101)(d); }
  Status* CreateCustomOpDomain(const char* domain, CustomOpDomain** out) const {
    return fn<Status* (*)(const char*, CustomOpDomain**)>(26)(domain, out);
  }
  Status* CustomOpDomain_Add(CustomOpDomain* domain, const CustomOp* op) const {
    return fn<Status* (*)(CustomOpDomain*, const CustomOp*)>(27)(domain, op);
  }
  Status* AddCustomOpDomain(SessionOptions* options, CustomOpDomain* domain) const {
    return fn<Status* (*)(SessionOptions*, CustomOpDomain*)>(28)(options, domain);
  }
  Status* GetTensorMutableData(Value* value, void** out) const {
    return fn<Status* (*)(Value*, void**)>(51)(value, out);
  }
  Status* GetTensorElementType(const TensorInfo* info, ElementType* out) const {
    return fn<Status* (*)(const TensorInfo*, ElementType*)>(60)(info, out);
  }
  Status* GetDimensionsCount(const TensorInfo* info, size_t* out) const {
    return fn<Status* (*)(const TensorInfo*, size_t*)>(SPECRT_ORT_DIMENSIONS_COUNT)(info, out);
  }
  Status* GetDimensions(const TensorInfo* info, int64_t* dims, size_t count) const {
    return fn<Status* (*)(const TensorInfo*, int64_t*, size_t)>(62)(info, dims, count);
  }
  Status* GetTensorTypeAndShape(const Value* value, TensorInfo** out) const {
    return fn<Status* (*)(const Value*, TensorInfo**)>(65)(value, out);
  }
  Status* KernelInfoGetAttribute_float(const KernelInfo* info, const char* name, float* out) const {
    return fn<Status* (*)(const KernelInfo*, const char*, float*)>(85)(info, name, out);
  }
  Status* KernelInfoGetAttribute_int64(const KernelInfo* info, const char* name, int64_t* out) const {
    return fn<Status* (*)(const KernelInfo*, const char*, int64_t*)>(86)(info, name, out);
  }
  Status* KernelInfoGetAttribute_string(const KernelInfo* info, const char* name, char* out, size_t* size) const {
    return fn<Status* (*)(const KernelInfo*, const char*, char*, size_t*)>(87)(info, name, out, size);
  }
  Status* KernelContext_GetInputCount(const KernelContext* ctx, size_t* out) const {
    return fn<Status* (*)(const KernelContext*, size_t*)>(88)(ctx, out);
  }
  Status* KernelContext_GetOutputCount(const KernelContext* ctx, size_t* out) const {
    return fn<Status* (*)(const KernelContext*, size_t*)>(89)(ctx, out);
  }
  Status* KernelContext_GetInput(const KernelContext* ctx, size_t index, const Value** out) const {
    return fn<Status* (*)(const KernelContext*, size_t, const Value**)>(90)(ctx, index, out);
  }
  Status* KernelContext_GetOutput(KernelContext* ctx, size_t index, const int64_t* dims, size_t count,
                                  Value** out) const {
    return fn<Status* (*)(KernelContext*, size_t, const int64_t*, size_t, Value**)>(91)(ctx, index, dims, count, out);
  }
  void ReleaseStatus(Status* s) const { fn<void (*)(Status*)>(93)(s); }
  void ReleaseTensorTypeAndShapeInfo(TensorInfo* info) const { fn<void (*)(TensorInfo*)>(99)(info); }
  Status* KernelInfo_GetInputCount(const KernelInfo* info, size_t* out) const {
    return fn<Status* (*)(const KernelInfo*, size_t*)>(230)(info, out);
  }
  Status* KernelInfoGetConstantInput_tensor(const KernelInfo* info, size_t index, int* is_constant,
                                            const Value** out) const {
    return fn<Status* (*)(const KernelInfo*, size_t, int*, const Value**)>(249)(info, index, is_constant, out);
  }
  Status* KernelContext_ParallelFor(const KernelContext* ctx, void (*f)(void*, size_t), size_t total,
                                    size_t num_batch, void* data) const {
    return fn<Status* (*)(const KernelContext*, void (*)(void*, size_t), size_t, size_t, void*)>(274)(
        ctx, f, total, num_batch, data);
  }

 private:
  template <class F>
  F fn(int index) const { return reinterpret_cast<F>(const_cast<void*>(t_[index])); }
  const void* const* t_;
};

}  // namespace ort

#if defined(SPECRT_ORT_HEADER)
#include <onnxruntime_c_api.h>

#include <cstddef>
#define SPECRT_SLOT(name, index) \
  static_assert(offsetof(OrtApi, name) / sizeof(void*) == (index), "ort_api.h: wrong index for " #name);
SPECRT_SLOT(CreateStatus, 0)
SPECRT_SLOT(GetErrorCode, 1)
SPECRT_SLOT(GetErrorMessage, 2)
SPECRT_SLOT(CreateCustomOpDomain, 26)
SPECRT_SLOT(CustomOpDomain_Add, 27)
SPECRT_SLOT(AddCustomOpDomain, 28)
SPECRT_SLOT(CreateTensorWithDataAsOrtValue, 49)
SPECRT_SLOT(GetTensorMutableData, 51)
SPECRT_SLOT(GetTensorElementType, 60)
SPECRT_SLOT(GetDimensionsCount, SPECRT_ORT_DIMENSIONS_COUNT)
SPECRT_SLOT(GetDimensions, 62)
SPECRT_SLOT(GetTensorTypeAndShape, 65)
SPECRT_SLOT(CreateCpuMemoryInfo, 69)
SPECRT_SLOT(KernelInfoGetAttribute_float, 85)
SPECRT_SLOT(KernelInfoGetAttribute_int64, 86)
SPECRT_SLOT(KernelInfoGetAttribute_string, 87)
SPECRT_SLOT(KernelContext_GetInputCount, 88)
SPECRT_SLOT(KernelContext_GetOutputCount, 89)
SPECRT_SLOT(KernelContext_GetInput, 90)
SPECRT_SLOT(KernelContext_GetOutput, 91)
SPECRT_SLOT(ReleaseStatus, 93)
SPECRT_SLOT(ReleaseMemoryInfo, 94)
SPECRT_SLOT(ReleaseValue, 96)
SPECRT_SLOT(ReleaseTensorTypeAndShapeInfo, 99)
SPECRT_SLOT(ReleaseCustomOpDomain, 101)
SPECRT_SLOT(KernelInfo_GetInputCount, 230)
SPECRT_SLOT(KernelInfoGetConstantInput_tensor, 249)
SPECRT_SLOT(KernelContext_ParallelFor, 274)
#undef SPECRT_SLOT
static_assert(ORT_API_VERSION >= 17, "onnxruntime_c_api.h older than 1.17");
#endif
