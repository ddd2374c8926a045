// Reading torch tensors' metadata and the arguments of a prepared call through the Python C API, without
// libtorch: what a prepared call (csrc/cpu/prepared.h, the cuda_host backend's) checks on every call
// before it trusts a pointer. Anything unexpected (another type, a tensor subclass, a failing attribute)
// reads as "not this call's argument", never as an error: the caller then takes the checked path, which
// words the error. Included by binding files only (it needs pybind11).
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>

namespace moe_comm::python {

namespace py = pybind11;

// torch's objects a prepared call compares against, looked up once.
struct TorchObjects {
    PyTypeObject* tensor = nullptr;  // torch.Tensor (exactly: subclasses take the checked path)
    py::object bfloat16, int32, int64, float32, boolean, empty;

    explicit TorchObjects(const py::module_& torch)
        : tensor(reinterpret_cast<PyTypeObject*>(torch.attr("Tensor").ptr())),
          bfloat16(torch.attr("bfloat16")),
          int32(torch.attr("int32")),
          int64(torch.attr("int64")),
          float32(torch.attr("float32")),
          boolean(torch.attr("bool")),
          empty(torch.attr("empty")) {}
};

// A tensor's data pointer, sizes and strides (in elements), up to 3 dimensions.
struct TensorArg {
    uint8_t* data = nullptr;
    int dim = 0;
    int64_t shape[3] = {0, 0, 0};
    int64_t stride[3] = {0, 0, 0};

    // Row-major with no gaps (dimensions of size 1 take any stride), as is_contiguous() says.
    bool contiguous() const {
        int64_t expected = 1;
        for (int i = dim - 1; i >= 0; --i) {
            if (shape[i] != 1 && stride[i] != expected) return false;
            expected *= shape[i];
        }
        return true;
    }
};

namespace detail {

inline PyObject* name(const char* text) { return PyUnicode_InternFromString(text); }

// A new reference to t.<attr>, or null (the error cleared).
inline PyObject* get(PyObject* t, PyObject* attr) {
    PyObject* v = PyObject_GetAttr(t, attr);
    if (v == nullptr) PyErr_Clear();
    return v;
}

// A tuple of ints into out[0..n); false unless it holds exactly n ints.
inline bool ints(PyObject* tuple, int n, int64_t* out) {
    if (tuple == nullptr || !PyTuple_Check(tuple) || PyTuple_GET_SIZE(tuple) != n) return false;
    for (int i = 0; i < n; ++i) {
        out[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(tuple, i));
        if (out[i] == -1 && PyErr_Occurred()) {
            PyErr_Clear();
            return false;
        }
    }
    return true;
}

}  // namespace detail

// Reads `t` when it is exactly a torch.Tensor on the CPU (`device` -1) or on CUDA device `device`, of `dtype`
// (one of torch's dtype objects), with `dim` dimensions; false otherwise (and for a null data pointer with
// elements).
inline bool read_tensor(py::handle t, const TorchObjects& torch, const py::object& dtype, int dim, TensorArg* out,
                        int device = -1) {
    static PyObject* const kDtype = detail::name("dtype");
    static PyObject* const kIsCpu = detail::name("is_cpu");
    static PyObject* const kIsCuda = detail::name("is_cuda");
    static PyObject* const kGetDevice = detail::name("get_device");
    static PyObject* const kShape = detail::name("shape");
    static PyObject* const kStride = detail::name("stride");
    static PyObject* const kDataPtr = detail::name("data_ptr");
    PyObject* obj = t.ptr();
    if (dim > 3 || Py_TYPE(obj) != torch.tensor) return false;
    PyObject* got = detail::get(obj, kDtype);
    const bool same_dtype = got == dtype.ptr();
    Py_XDECREF(got);
    if (!same_dtype) return false;
    got = detail::get(obj, device < 0 ? kIsCpu : kIsCuda);
    const bool there = got == Py_True;
    Py_XDECREF(got);
    if (!there) return false;
    if (device >= 0) {
        int64_t index = -1;
        got = PyObject_CallMethodNoArgs(obj, kGetDevice);
        if (got == nullptr) {
            PyErr_Clear();
        } else {
            index = PyLong_AsLongLong(got);
            if (index == -1 && PyErr_Occurred()) PyErr_Clear();
            Py_DECREF(got);
        }
        if (index != device) return false;
    }
    got = detail::get(obj, kShape);
    bool ok = detail::ints(got, dim, out->shape);
    Py_XDECREF(got);
    if (!ok) return false;
    got = PyObject_CallMethodNoArgs(obj, kStride);
    if (got == nullptr) PyErr_Clear();
    ok = detail::ints(got, dim, out->stride);
    Py_XDECREF(got);
    if (!ok) return false;
    got = PyObject_CallMethodNoArgs(obj, kDataPtr);
    if (got == nullptr) {
        PyErr_Clear();
        return false;
    }
    out->data = static_cast<uint8_t*>(PyLong_AsVoidPtr(got));
    Py_DECREF(got);
    if (PyErr_Occurred()) {
        PyErr_Clear();
        return false;
    }
    out->dim = dim;
    int64_t numel = 1;
    for (int i = 0; i < dim; ++i) numel *= out->shape[i];
    return out->data != nullptr || numel == 0;
}

// Whether `got` equals `want` element for element with the same exact types (True never stands for 1,
// nor a numpy integer for an int): the scalars of a call against those its prepared call was made for.
inline bool same_key(py::handle got, py::handle want) {
    PyObject* a = got.ptr();
    PyObject* b = want.ptr();
    if (!PyTuple_CheckExact(a) || !PyTuple_CheckExact(b) || PyTuple_GET_SIZE(a) != PyTuple_GET_SIZE(b)) return false;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(a); ++i) {
        PyObject* x = PyTuple_GET_ITEM(a, i);
        PyObject* y = PyTuple_GET_ITEM(b, i);
        if (x == y) continue;
        if (Py_TYPE(x) != Py_TYPE(y)) return false;
        if (PyTuple_CheckExact(x)) {
            if (!same_key(x, y)) return false;
            continue;
        }
        const int equal = PyObject_RichCompareBool(x, y, Py_EQ);
        if (equal != 1) {
            if (equal < 0) PyErr_Clear();
            return false;
        }
    }
    return true;
}

}  // namespace moe_comm::python
