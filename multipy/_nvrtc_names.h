/*
 * NVRTC's entry points that its forwarder (_nvrtc_forward.c) exports, one NAME(...) a
 * line, for the X-macro includes of _forward.h.
 *
 * Made from the functions that libnvrtc.so.13 of nvidia-cuda-nvrtc 13.0.88 exports:
 *     nm -D --defined-only libnvrtc.so.13 | awk '$2 == "T" {sub("@.*", "", $3);
 *         print "NAME(" $3 ")"}' | sort
 * The host forwards a copy only when it exports no name missing here
 * (multipy/_cuda.py), so a later release with more names is loaded by each interpreter
 * itself, as without multipy, until this list is made anew from it.
 */
NAME(__nvrtcCPEx)
NAME(nvrtcAddNameExpression)
NAME(nvrtcCompileProgram)
NAME(nvrtcCreateProgram)
NAME(nvrtcDestroyProgram)
NAME(nvrtcGetCUBIN)
NAME(nvrtcGetCUBINSize)
NAME(nvrtcGetErrorString)
NAME(nvrtcGetLTOIR)
NAME(nvrtcGetLTOIRSize)
NAME(nvrtcGetLoweredName)
NAME(nvrtcGetNumSupportedArchs)
NAME(nvrtcGetOptiXIR)
NAME(nvrtcGetOptiXIRSize)
NAME(nvrtcGetPCHCreateStatus)
NAME(nvrtcGetPCHHeapSize)
NAME(nvrtcGetPCHHeapSizeRequired)
NAME(nvrtcGetPTX)
NAME(nvrtcGetPTXSize)
NAME(nvrtcGetProgramLog)
NAME(nvrtcGetProgramLogSize)
NAME(nvrtcGetSupportedArchs)
NAME(nvrtcSetFlowCallback)
NAME(nvrtcSetPCHHeapSize)
NAME(nvrtcVersion)
