package idemhttp

import (
	"mime"
	"net/http"
	"strings"
)

// isGRPC reports whether r is a call of the gRPC or the gRPC-Web protocol,
// by its media type: application/grpc, application/grpc+proto,
// application/grpc-web, application/grpc-web-text+proto and the like.
func isGRPC(r *http.Request) bool {
	mediaType, _, _ := mime.ParseMediaType(r.Header.Get("Content-Type"))
	return mediaType == "application/grpc" || strings.HasPrefix(mediaType, "application/grpc+") ||
		strings.HasPrefix(mediaType, "application/grpc-web")
}

// grpcRefusal is the grpc-message of refuseGRPC's answer: printable ASCII
// without '%', which the protocols send as it is.
const grpcRefusal = "idemhttp cannot make gRPC or gRPC-Web calls exactly-once: their status travels in trailers, " +
	"which it does not store, so a replay would be half an answer; serve them with the interceptor of github.com/pgidem/idem/idemgrpc"

// refuseGRPC answers a gRPC or gRPC-Web call of a covered method in the
// protocol's own form, so that its client reads a status and a message
// rather than fails on an answer it cannot parse: a response without a
// message, whose status, UNIMPLEMENTED, is in its header (a
// "trailers-only" response, which both protocols define). The handler does
// not run and nothing is stored.
func refuseGRPC(w http.ResponseWriter, r *http.Request) {
	h := w.Header()
	h.Set("Content-Type", r.Header.Get("Content-Type"))
	h.Set("Grpc-Status", "12") // UNIMPLEMENTED
	h.Set("Grpc-Message", grpcRefusal)
	w.WriteHeader(http.StatusOK)
}
