package idemgrpc

import (
	"bytes"
	"compress/gzip"
	"fmt"
	"io"
	"mime"
	"net/http"
	"strings"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"

	"github.com/pgidem/idem"
)

// maxConnectMessage bounds the message that ConnectFingerprint
// decompresses, as gRPC's default limit on a received message does.
const maxConnectMessage = 4 << 20

// ConnectFingerprint is a Config.Fingerprint for idemhttp in front of
// connect-go handlers: it fingerprints a unary call of the Connect
// protocol by its message rather than by its bytes. connect-go's binary
// codec, like protobuf's default serialization, writes the entries of a
// map in no fixed order, so that a client's retry of the same message can
// differ byte for byte, and idemhttp's DefaultFingerprint would refuse it
// as a different request (422 key-reused).
//
// It finds the method's request type by the request's path
// (/package.Service/Method) in protobuf's global registry, where generated
// code registers it; decodes the body (application/proto, or
// application/json as protojson, gzip-compressed or not, at most 4 MiB
// decompressed); and returns the SHA-256 digest of the method, the target
// URI, the codec and the message in protobuf's deterministic
// serialization. The same message sent with the other codec is another
// request: its stored answer is in the first codec. It returns an error,
// which idemhttp answers 400 fingerprint-failed, for a method or a codec it
// does not know and for a body it cannot decode; and for a method other
// than POST, since a Connect GET carries its message in the URL.
//
//	mw, err := idemhttp.NewMiddleware(pool, idemhttp.Config{
//		Scope:       tenantOf,
//		Fingerprint: idemgrpc.ConnectFingerprint,
//		Store:       idemhttp.StoreDefinite,
//	})
//
// docs/grpc.md says what else to configure for Connect.
func ConnectFingerprint(r *http.Request, body []byte) ([]byte, error) {
	if r.Method != http.MethodPost {
		return nil, fmt.Errorf("idemgrpc: ConnectFingerprint: a %s carries no message in its body; cover POST only", r.Method)
	}
	input, err := connectInput(r.URL.Path)
	if err != nil {
		return nil, err
	}
	switch encoding := r.Header.Get("Content-Encoding"); encoding {
	case "", "identity":
	case "gzip":
		if body, err = gunzip(body); err != nil {
			return nil, err
		}
	default:
		return nil, fmt.Errorf("idemgrpc: ConnectFingerprint: the body is compressed with %q, which it cannot read", encoding)
	}
	msg := input.New().Interface()
	mediaType, _, _ := mime.ParseMediaType(r.Header.Get("Content-Type"))
	var codec string
	switch mediaType {
	case "application/proto":
		codec, err = "proto", proto.Unmarshal(body, msg)
	case "application/json":
		// As connect-go's JSON codec reads it.
		codec, err = "json", protojson.UnmarshalOptions{DiscardUnknown: true}.Unmarshal(body, msg)
	default:
		return nil, fmt.Errorf("idemgrpc: ConnectFingerprint: %q is not a unary Connect codec (application/proto or application/json)", mediaType)
	}
	if err != nil {
		return nil, fmt.Errorf("idemgrpc: ConnectFingerprint: decode a %s: %w", input.Descriptor().FullName(), err)
	}
	wire, err := proto.MarshalOptions{Deterministic: true}.Marshal(msg)
	if err != nil {
		return nil, fmt.Errorf("idemgrpc: ConnectFingerprint: %w", err)
	}
	return idem.Fingerprint([]byte(r.Method), []byte(r.URL.RequestURI()), []byte(codec), wire), nil
}

// connectInput returns the request type of the method whose procedure ends
// path.
func connectInput(path string) (protoreflect.MessageType, error) {
	parts := strings.Split(strings.TrimSuffix(path, "/"), "/")
	if len(parts) < 3 {
		return nil, fmt.Errorf("idemgrpc: ConnectFingerprint: the path %q does not end in /package.Service/Method", path)
	}
	service, method := protoreflect.FullName(parts[len(parts)-2]), protoreflect.Name(parts[len(parts)-1])
	d, err := protoregistry.GlobalFiles.FindDescriptorByName(service)
	if err != nil {
		return nil, fmt.Errorf("idemgrpc: ConnectFingerprint: the service %s is not in protobuf's global registry: %w", service, err)
	}
	sd, ok := d.(protoreflect.ServiceDescriptor)
	if !ok || sd.Methods().ByName(method) == nil {
		return nil, fmt.Errorf("idemgrpc: ConnectFingerprint: %s has no method %s", service, method)
	}
	input := sd.Methods().ByName(method).Input().FullName()
	mt, err := protoregistry.GlobalTypes.FindMessageByName(input)
	if err != nil {
		return nil, fmt.Errorf("idemgrpc: ConnectFingerprint: the request type %s is not in protobuf's global registry: %w", input, err)
	}
	return mt, nil
}

// gunzip decompresses body, up to maxConnectMessage bytes.
func gunzip(body []byte) ([]byte, error) {
	zr, err := gzip.NewReader(bytes.NewReader(body))
	if err != nil {
		return nil, fmt.Errorf("idemgrpc: ConnectFingerprint: gunzip the body: %w", err)
	}
	out, err := io.ReadAll(io.LimitReader(zr, maxConnectMessage+1))
	switch {
	case err != nil:
		return nil, fmt.Errorf("idemgrpc: ConnectFingerprint: gunzip the body: %w", err)
	case len(out) > maxConnectMessage:
		return nil, fmt.Errorf("idemgrpc: ConnectFingerprint: the body is more than %d bytes decompressed", maxConnectMessage)
	}
	return out, nil
}
