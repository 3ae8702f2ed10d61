package idemgrpc

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"

	"github.com/jackc/pgx/v5"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	"github.com/pgidem/idem"
)

// interceptor is a checked Config on a database.
type interceptor struct {
	db idem.TxBeginner
	settings
}

// NewServerInterceptor checks cfg, applies its defaults and returns the
// unary server interceptor that makes the covered methods exactly-once per
// (scope, key) on db. It refuses a nil db, and every field of cfg that
// cannot work, such as a nil Scope, a retention under a microsecond or a
// wait longer than PostgreSQL's lock_timeout can express, with an error
// that names the field and wraps [idem.ErrInvalidOption]: a misconfigured
// server must not start.
//
// Install it with grpc.UnaryInterceptor or grpc.ChainUnaryInterceptor,
// after the interceptors that authenticate the caller, which Config.Scope
// reads, and after a recovery interceptor, if any: a panic in the handler
// rolls its transaction back and goes on up the chain, as it would without
// idem. See the package documentation for the answers it gives.
func NewServerInterceptor(db idem.TxBeginner, cfg Config) (grpc.UnaryServerInterceptor, error) {
	if db == nil {
		return nil, invalidField("NewServerInterceptor", "needs a database, got nil")
	}
	s, err := newSettings(cfg)
	if err != nil {
		return nil, err
	}
	i := &interceptor{db: db, settings: s}
	return i.intercept, nil
}

// callKey is the context key under which the handler finds its callValues.
type callKey struct{}

// callValues are what the interceptor tells the handler about its call.
type callValues struct {
	tx         pgx.Tx
	scope, key string
	// For a method that Config.Flows lists, what RunFlow needs: the
	// interceptor, whose configuration the flow runs with, and the call.
	flows  *interceptor
	fp     []byte
	method string
	stream grpc.ServerTransportStream
}

// Tx returns the transaction the interceptor opened for the call whose
// context is ctx, or nil outside a covered method and in a method that
// [Config.Flows] lists, for which it opens none. The handler does its
// writes on it: they commit together with the key's claim and the stored
// answer, or not at all. The handler must not commit or roll it back.
func Tx(ctx context.Context) pgx.Tx {
	v, _ := ctx.Value(callKey{}).(callValues)
	return v.tx
}

// Key returns the idempotency key of the call whose context is ctx, or ""
// when it has none or its method is not covered. A handler that calls
// another service can derive that call's own idempotency key from it, so
// that a run repeated after a rollback does not repeat the call.
func Key(ctx context.Context) string {
	v, _ := ctx.Value(callKey{}).(callValues)
	return v.key
}

// Scope returns the scope that [Config.Scope] gave the call whose context
// is ctx, under which its key is claimed, or "" when it has no key or its
// method is not covered.
func Scope(ctx context.Context) string {
	v, _ := ctx.Value(callKey{}).(callValues)
	return v.scope
}

// call is one covered call on its way through the interceptor.
type call struct {
	req     any
	info    *grpc.UnaryServerInfo
	handler grpc.UnaryHandler
	// stream is the call's own, to which the answer's metadata goes.
	stream grpc.ServerTransportStream
}

func (i *interceptor) intercept(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	covered, required := i.covers(info.FullMethod)
	if !covered {
		return handler(ctx, req)
	}
	c := call{req: req, info: info, handler: handler, stream: grpc.ServerTransportStreamFromContext(ctx)}
	msg, ok := req.(proto.Message)
	if c.stream == nil || !ok {
		return nil, i.failed(ctx, info.FullMethod,
			fmt.Errorf("idemgrpc: covers only gRPC calls of protobuf messages: the request is a %T, the call's stream %v", req, c.stream), false)
	}
	key, keyField, err := i.keyOf(ctx, msg)
	var keyErr *keyError
	switch {
	case errors.Is(err, errNoKey) && !required:
		return i.serveUnkeyed(ctx, c)
	case errors.Is(err, errNoKey):
		return nil, newStatus(codes.InvalidArgument, ReasonKeyMissing,
			"idemgrpc: this method needs an idempotency key, in the metadata "+i.metadata+i.orField(), nil)
	case errors.As(err, &keyErr):
		return nil, newStatus(codes.InvalidArgument, ReasonKeyInvalid, "idemgrpc: the idempotency key "+keyErr.problem, nil)
	case err != nil:
		return nil, i.failed(ctx, info.FullMethod, err, false)
	}
	scope, err := i.scope(ctx)
	if err != nil {
		// The error is the server's view of the caller, which the client
		// has no business reading.
		return nil, newStatus(codes.Unauthenticated, ReasonScopeUnknown,
			"idemgrpc: the call does not say who is calling, so its idempotency key cannot be scoped", nil)
	}
	fp, err := i.fingerprintOf(info.FullMethod, msg, keyField)
	if err != nil {
		return nil, newStatus(codes.InvalidArgument, ReasonFingerprintFailed,
			"idemgrpc: the request cannot be fingerprinted to check its idempotency key", nil)
	}
	if i.flows[info.FullMethod] {
		return i.serveFlow(ctx, c, callValues{scope: scope, key: key}, fp)
	}
	return i.serveKeyed(ctx, c, callValues{scope: scope, key: key}, fp)
}

// serveKeyed runs the handler under the claim of the call's scope and key,
// or replays the answer stored for them.
func (i *interceptor) serveKeyed(ctx context.Context, c call, v callValues, fp []byte) (any, error) {
	var (
		rec        *recorder
		resp       any
		handlerErr error
	)
	res, err := idem.Run(ctx, i.db, v.scope, v.key, fp, func(ctx context.Context, tx pgx.Tx) (storedCall, error) {
		v.tx = tx
		rec, resp, handlerErr = i.runHandler(ctx, c, v)
		if handlerErr != nil && !i.store(status.Code(handlerErr)) {
			return storedCall{}, errNotStored
		}
		return storeAnswer(rec, resp, handlerErr, i.maxResponseBytes)
	}, i.runOptions...)

	switch {
	case err == nil && res.Replayed:
		resp, err := replay(c.stream, res.Value, notStored)
		if errors.Is(err, errStoredAnswer) {
			return nil, i.failed(ctx, c.info.FullMethod, err, true)
		}
		return resp, err
	case err == nil:
		if res.Value.NotStored > 0 {
			i.logger.LogAttrs(ctx, slog.LevelWarn,
				"idemgrpc: answer too large to store; it committed, and its retries get ALREADY_EXISTS "+ReasonResponseNotStored,
				slog.String("method", c.info.FullMethod), slog.String("code", res.Value.NotStoredCode.String()),
				slog.Int("bytes", res.Value.NotStored), slog.Int("max_response_bytes", i.maxResponseBytes))
		}
		rec.forward()
		return resp, handlerErr
	case errors.Is(err, errNotStored):
		// The handler's own answer, which Config.Store keeps out: it goes
		// to the client as it is, and everything rolled back.
		rec.forward()
		return resp, handlerErr
	}
	return nil, i.errorOf(ctx, c, err)
}

// serveUnkeyed runs the handler in a transaction without a claim: what it
// writes commits unless it fails with an error that Config.Store refuses.
func (i *interceptor) serveUnkeyed(ctx context.Context, c call) (any, error) {
	var (
		rec        *recorder
		resp       any
		handlerErr error
	)
	err := idem.WithTx(ctx, i.db, i.txOptions, func(ctx context.Context, tx pgx.Tx) error {
		rec, resp, handlerErr = i.runHandler(ctx, c, callValues{tx: tx})
		if handlerErr != nil && !i.store(status.Code(handlerErr)) {
			return errNotStored
		}
		return nil
	})
	if err != nil && !errors.Is(err, errNotStored) {
		return nil, i.failed(ctx, c.info.FullMethod, err, false)
	}
	rec.forward()
	return resp, handlerErr
}

// errNotStored is a handler's error that Config.Store keeps out, returned
// to idem so that the transaction rolls back.
var errNotStored = errors.New("idemgrpc: the handler's error is not stored")

// runHandler runs the handler once in the transaction of v, with a
// recorder for the metadata it sets.
func (i *interceptor) runHandler(ctx context.Context, c call, v callValues) (*recorder, any, error) {
	rec := &recorder{stream: c.stream}
	ctx = grpc.NewContextWithServerTransportStream(context.WithValue(ctx, callKey{}, v), rec)
	resp, err := c.handler(ctx, c.req)
	return rec, resp, err
}

// notStored is the answer to the retry of a call whose answer was too
// large to store.
func notStored(stored storedCall) error {
	return newStatus(codes.AlreadyExists, ReasonResponseNotStored,
		fmt.Sprintf("idemgrpc: the call with this idempotency key completed with code %s, but its answer of %d bytes was too large to keep, "+
			"so it cannot be sent again; the call will not run again: do not retry it", stored.NotStoredCode, stored.NotStored),
		map[string]string{"code": strconv.Itoa(int(stored.NotStoredCode))})
}

// errNoKey says that a call carries no key.
var errNoKey = errors.New("idemgrpc: the call has no idempotency key")

// keyError is a call's key that cannot be used.
type keyError struct {
	// problem completes "the idempotency key ...".
	problem string
}

func (e *keyError) Error() string { return "idemgrpc: the idempotency key " + e.problem }

// keyOf returns the key of the call whose request is msg, read from the
// metadata and from Config.KeyField, with the field it was read from, if
// any. It returns errNoKey when the call has none, and a *keyError when
// its key cannot be used.
func (i *interceptor) keyOf(ctx context.Context, msg proto.Message) (string, protoreflect.FieldDescriptor, error) {
	md, _ := metadata.FromIncomingContext(ctx)
	values := md.Get(i.metadata)
	if len(values) > 1 {
		return "", nil, &keyError{problem: "is sent more than once, in the metadata " + i.metadata}
	}
	inField, field, err := i.fieldKey(msg)
	if err != nil {
		return "", nil, err
	}
	if len(values) == 0 && inField == "" {
		return "", nil, errNoKey
	}
	if len(values) == 1 && inField != "" && values[0] != inField {
		return "", nil, &keyError{problem: fmt.Sprintf("differs between the metadata %s and the request's field %s", i.metadata, i.keyField)}
	}
	key := inField
	if len(values) == 1 {
		key = values[0]
	}
	switch {
	case key == "":
		return "", nil, &keyError{problem: "is empty"}
	case len(key) > idem.MaxKeyLength:
		return "", nil, &keyError{problem: fmt.Sprintf("is %d bytes long, more than %d", len(key), idem.MaxKeyLength)}
	}
	return key, field, nil
}

// fieldKey returns the key that msg holds in Config.KeyField, "" when it
// has no such field or the field is empty, and the field.
func (i *interceptor) fieldKey(msg proto.Message) (string, protoreflect.FieldDescriptor, error) {
	if i.keyField == "" {
		return "", nil, nil
	}
	m := msg.ProtoReflect()
	fd := m.Descriptor().Fields().ByName(i.keyField)
	if fd == nil {
		return "", nil, nil
	}
	if fd.Kind() != protoreflect.StringKind || fd.Cardinality() == protoreflect.Repeated {
		return "", nil, fmt.Errorf("idemgrpc: Config.KeyField: the field %s of %s is a %s %s, not a singular string",
			i.keyField, m.Descriptor().FullName(), fd.Cardinality(), fd.Kind())
	}
	return m.Get(fd).String(), fd, nil
}

// orField completes "in the metadata x" with the request's key field.
func (i *interceptor) orField() string {
	if i.keyField == "" {
		return ""
	}
	return " or the request's field " + string(i.keyField)
}

// fingerprintOf returns the fingerprint of the call of fullMethod with the
// request msg, without its key field.
func (i *interceptor) fingerprintOf(fullMethod string, msg proto.Message, keyField protoreflect.FieldDescriptor) ([]byte, error) {
	if keyField != nil && msg.ProtoReflect().Has(keyField) {
		msg = proto.Clone(msg)
		msg.ProtoReflect().Clear(keyField)
	}
	if i.fingerprint != nil {
		return i.fingerprint(fullMethod, msg)
	}
	wire, err := proto.MarshalOptions{Deterministic: true}.Marshal(msg)
	if err != nil {
		return nil, err
	}
	return idem.Fingerprint([]byte(fullMethod), wire), nil
}

// errorOf answers a keyed call for which idem.Run returned err, other than
// the handler's own answer: the key reused, still in progress, the
// database unavailable, or another failure, logged.
func (i *interceptor) errorOf(ctx context.Context, c call, err error) error {
	switch {
	case errors.Is(err, idem.ErrFingerprintMismatch):
		return newStatus(codes.FailedPrecondition, ReasonKeyReused,
			"idemgrpc: this idempotency key was already used for a different request; use a new key for a new request", nil)
	case errors.Is(err, idem.ErrInProgress):
		return i.inProgress(c.stream)
	case errors.Is(err, idem.ErrInvalidKey):
		return newStatus(codes.InvalidArgument, ReasonKeyInvalid, "idemgrpc: the idempotency key is not valid", nil)
	}
	return i.failed(ctx, c.info.FullMethod, err, true)
}
