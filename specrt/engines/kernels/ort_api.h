// The parts of onnxruntime's C API this library uses, declared from its documentation (onnxruntime's
// "C API" reference, onnxruntime_c_api.h). OrtApi is a table of function pointers that only ever grows at
// its end, so each function is identified by its index in the table; every index below exists since the
// API version named, and the library asks for version 17 (onnxruntime 1.17), the first with
// KernelContext_ParallelFor.
#pragma once

#include <cstddef>
#include <cstdint>

namespace ort {

struct Status;
struct KernelInfo;
struct KernelContext;
struct Value;
struct TensorInfo;
struct SessionOptions;
struct CustomOpDomain;

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
    return fn<Status* (*)(const TensorInfo*, size_t*)>(61)(info, out);
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
