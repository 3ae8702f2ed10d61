package testpb

import (
	"context"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// Written by hand, as protoc-gen-go-grpc would write it, shorter: the
// tests need the service, not a code generator.

// Full method names of the Payments service.
const (
	PaymentsPay   = "/idemgrpc.test.v1.Payments/Pay"
	PaymentsWatch = "/idemgrpc.test.v1.Payments/Watch"
	PaymentsGet   = "/idemgrpc.test.v1.Payments/Get"
)

// PaymentsServer is the server side of the Payments service. Its functions
// may be nil: a nil Watch is not called, a nil Get answers UNIMPLEMENTED.
type PaymentsServer struct {
	Pay   func(ctx context.Context, req *PayRequest) (*Payment, error)
	Watch func(req *PayRequest, stream grpc.ServerStreamingServer[Payment]) error
	Get   func(ctx context.Context, req *PayRequest) (*Payment, error)
}

// Register registers srv on s.
func (srv *PaymentsServer) Register(s grpc.ServiceRegistrar) {
	s.RegisterService(&grpc.ServiceDesc{
		ServiceName: "idemgrpc.test.v1.Payments",
		HandlerType: (*any)(nil),
		Methods: []grpc.MethodDesc{
			srv.unary("Pay", PaymentsPay, &srv.Pay),
			srv.unary("Get", PaymentsGet, &srv.Get),
		},
		Streams: []grpc.StreamDesc{{
			StreamName:    "Watch",
			ServerStreams: true,
			Handler: func(_ any, stream grpc.ServerStream) error {
				in := new(PayRequest)
				if err := stream.RecvMsg(in); err != nil {
					return err
				}
				return srv.Watch(in, &grpc.GenericServerStream[PayRequest, Payment]{ServerStream: stream})
			},
		}},
		Metadata: "payments.proto",
	}, srv)
}

// unary is the description of the unary method name, served by the
// function *fn holds when it is called.
func (srv *PaymentsServer) unary(name, fullMethod string, fn *func(context.Context, *PayRequest) (*Payment, error)) grpc.MethodDesc {
	return grpc.MethodDesc{
		MethodName: name,
		Handler: func(_ any, ctx context.Context, dec func(any) error, interceptor grpc.UnaryServerInterceptor) (any, error) {
			in := new(PayRequest)
			if err := dec(in); err != nil {
				return nil, err
			}
			handler := func(ctx context.Context, req any) (any, error) {
				if *fn != nil {
					return (*fn)(ctx, req.(*PayRequest))
				}
				return nil, status.Error(codes.Unimplemented, name+" is not implemented")
			}
			if interceptor == nil {
				return handler(ctx, in)
			}
			return interceptor(ctx, in, &grpc.UnaryServerInfo{Server: srv, FullMethod: fullMethod}, handler)
		},
	}
}

// PaymentsClient is the client side of the Payments service.
type PaymentsClient struct{ cc grpc.ClientConnInterface }

// NewPaymentsClient returns a client on cc.
func NewPaymentsClient(cc grpc.ClientConnInterface) PaymentsClient { return PaymentsClient{cc: cc} }

// Pay calls Payments.Pay.
func (c PaymentsClient) Pay(ctx context.Context, in *PayRequest, opts ...grpc.CallOption) (*Payment, error) {
	out := new(Payment)
	if err := c.cc.Invoke(ctx, PaymentsPay, in, out, opts...); err != nil {
		return nil, err
	}
	return out, nil
}

// Get calls Payments.Get.
func (c PaymentsClient) Get(ctx context.Context, in *PayRequest, opts ...grpc.CallOption) (*Payment, error) {
	out := new(Payment)
	if err := c.cc.Invoke(ctx, PaymentsGet, in, out, opts...); err != nil {
		return nil, err
	}
	return out, nil
}

// Watch calls Payments.Watch.
func (c PaymentsClient) Watch(ctx context.Context, in *PayRequest, opts ...grpc.CallOption) (grpc.ServerStreamingClient[Payment], error) {
	desc := &grpc.StreamDesc{StreamName: "Watch", ServerStreams: true}
	stream, err := c.cc.NewStream(ctx, desc, PaymentsWatch, opts...)
	if err != nil {
		return nil, err
	}
	x := &grpc.GenericClientStream[PayRequest, Payment]{ClientStream: stream}
	if err := x.SendMsg(in); err != nil {
		return nil, err
	}
	if err := x.CloseSend(); err != nil {
		return nil, err
	}
	return x, nil
}
