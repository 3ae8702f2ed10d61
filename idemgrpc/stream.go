package idemgrpc

import (
	"errors"
	"fmt"
	"strings"
	"sync"

	spb "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"

	"github.com/pgidem/idem"
)

// storedCall is the value idem stores for a key and replays. The message
// and the metadata values are []byte, which encoding/json writes as
// base64: they survive the jsonb column byte for byte, whatever they hold,
// binary ("-bin") metadata included.
type storedCall struct {
	// Type is the full name of the response message, by which a replay
	// finds its Go type in the registry; empty for a stored error.
	Type string `json:"type,omitempty"`
	// Response is the response message in the protobuf wire format.
	Response []byte `json:"response,omitempty"`
	// Status is the handler's error, a google.rpc.Status in the wire
	// format, when the error was stored (see Config.Store).
	Status  []byte              `json:"status,omitempty"`
	Header  map[string][][]byte `json:"header,omitempty"`
	Trailer map[string][][]byte `json:"trailer,omitempty"`
	// NotStored is the size of an answer too large to store, which
	// Response or Status then lacks, and NotStoredCode its code.
	NotStored     int        `json:"not_stored,omitempty"`
	NotStoredCode codes.Code `json:"not_stored_code,omitempty"`
}

// recorder is the grpc.ServerTransportStream a covered handler sees: it
// keeps the header and trailer metadata the handler sets (grpc.SetHeader,
// grpc.SendHeader, grpc.SetTrailer) until the transaction has committed,
// so that nothing reaches the client before the answer is stored. Only
// then does forward hand them to the call's own stream.
type recorder struct {
	stream grpc.ServerTransportStream

	mu         sync.Mutex
	header     metadata.MD
	trailer    metadata.MD
	headerSent bool
}

var _ grpc.ServerTransportStream = (*recorder)(nil)

func (r *recorder) Method() string { return r.stream.Method() }

func (r *recorder) SetHeader(md metadata.MD) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.headerSent {
		return errHeaderSent
	}
	r.header = metadata.Join(r.header, md)
	return nil
}

// SendHeader cannot send before the transaction commits: the header goes
// out with the answer, as if the handler had called SetHeader.
func (r *recorder) SendHeader(md metadata.MD) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.headerSent {
		return errHeaderSent
	}
	r.header = metadata.Join(r.header, md)
	r.headerSent = true
	return nil
}

func (r *recorder) SetTrailer(md metadata.MD) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.trailer = metadata.Join(r.trailer, md)
	return nil
}

// errHeaderSent is what grpc-go's own stream answers to a header set after
// it was sent.
var errHeaderSent = status.Error(codes.Internal, "transport: SendHeader called multiple times")

// metadataOf returns the header and the trailer the handler set, in their
// stored form.
func (r *recorder) metadataOf() (header, trailer map[string][][]byte) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return storeMetadata(r.header), storeMetadata(r.trailer)
}

// forward hands the header and the trailer the handler set to the call's
// own stream, which sends them with the answer.
func (r *recorder) forward() {
	r.mu.Lock()
	header, trailer := r.header, r.trailer
	r.mu.Unlock()
	setMetadata(r.stream, header, trailer)
}

// setMetadata sets header and trailer on stream. It cannot fail in a way
// anyone can be told of: the call is ending.
func setMetadata(stream grpc.ServerTransportStream, header, trailer metadata.MD) {
	if header.Len() > 0 {
		_ = stream.SetHeader(header)
	}
	if trailer.Len() > 0 {
		_ = stream.SetTrailer(trailer)
	}
}

// neverReplayed lists the metadata keys that are never stored or replayed:
// credentials, which must not reach whoever retries with a key, and the
// mark of a replay itself.
var neverReplayed = map[string]bool{
	"authorization":       true,
	"proxy-authorization": true,
	"cookie":              true,
	"set-cookie":          true,
	"www-authenticate":    true,
	ReplayedMetadata:      true,
}

// storeMetadata returns md in its stored form, without the keys that are
// never replayed and gRPC's own.
func storeMetadata(md metadata.MD) map[string][][]byte {
	var out map[string][][]byte
	for key, values := range md {
		key = strings.ToLower(key)
		if neverReplayed[key] || strings.HasPrefix(key, "grpc-") {
			continue
		}
		if out == nil {
			out = make(map[string][][]byte, len(md))
		}
		for _, v := range values {
			out[key] = append(out[key], []byte(v))
		}
	}
	return out
}

// replayMetadata turns stored metadata back into metadata.MD.
func replayMetadata(stored map[string][][]byte) metadata.MD {
	md := make(metadata.MD, len(stored)+1)
	for key, values := range stored {
		for _, v := range values {
			md[key] = append(md[key], string(v))
		}
	}
	return md
}

// storeAnswer returns what is stored of the handler's answer: its response
// or its error, and the metadata it set. An answer of more than max bytes
// is stored without its message. An answer that cannot be stored at all,
// a bug of the server's, is an error that wraps idem.ErrResponseNotStorable.
func storeAnswer(rec *recorder, resp any, handlerErr error, max int) (storedCall, error) {
	var stored storedCall
	stored.Header, stored.Trailer = rec.metadataOf()
	var (
		wire []byte
		code = codes.OK
		err  error
	)
	if handlerErr != nil {
		st := status.Convert(handlerErr)
		code = st.Code()
		wire, err = proto.Marshal(st.Proto())
		stored.Status = wire
	} else {
		msg, ok := resp.(proto.Message)
		if !ok || msg == nil {
			return storedCall{}, fmt.Errorf("%w: idemgrpc: the handler's response is a %T, not a protobuf message: only protobuf messages can be stored",
				idem.ErrResponseNotStorable, resp)
		}
		name := msg.ProtoReflect().Descriptor().FullName()
		if _, err := protoregistry.GlobalTypes.FindMessageByName(name); err != nil {
			return storedCall{}, fmt.Errorf("%w: idemgrpc: the response type %s is not in protobuf's global registry, where a replay would look for it: %w",
				idem.ErrResponseNotStorable, name, err)
		}
		stored.Type = string(name)
		wire, err = proto.Marshal(msg)
		stored.Response = wire
	}
	if err != nil {
		return storedCall{}, fmt.Errorf("%w: idemgrpc: encode the answer: %w", idem.ErrResponseNotStorable, err)
	}
	if len(wire) > max {
		stored.Response, stored.Status = nil, nil
		stored.NotStored, stored.NotStoredCode = len(wire), code
	}
	return stored, nil
}

// replay turns a stored answer back into the response or the error of the
// call, and sets its metadata on stream, marked as a replay.
func replay(stream grpc.ServerTransportStream, stored storedCall, notStored func(storedCall) error) (any, error) {
	header := replayMetadata(stored.Header)
	header.Set(ReplayedMetadata, "true")
	setMetadata(stream, header, replayMetadata(stored.Trailer))
	switch {
	case stored.NotStored > 0:
		return nil, notStored(stored)
	case stored.Type == "":
		st := &spb.Status{}
		if err := proto.Unmarshal(stored.Status, st); err != nil {
			return nil, fmt.Errorf("%w: status: %w", errStoredAnswer, err)
		}
		if st.GetCode() == int32(codes.OK) {
			return nil, fmt.Errorf("%w: a stored error with code OK", errStoredAnswer)
		}
		return nil, status.ErrorProto(st)
	}
	mt, err := protoregistry.GlobalTypes.FindMessageByName(protoreflect.FullName(stored.Type))
	if err != nil {
		return nil, fmt.Errorf("%w: response type: %w", errStoredAnswer, err)
	}
	msg := mt.New().Interface()
	if err := proto.Unmarshal(stored.Response, msg); err != nil {
		return nil, fmt.Errorf("%w: response: %w", errStoredAnswer, err)
	}
	return msg, nil
}

// errStoredAnswer is a stored answer that cannot be read back.
var errStoredAnswer = errors.New("idemgrpc: the stored answer cannot be read")
